"""Checkpoints: whole-run ones (``run``), written per shard by data-parallel ranks and resharded on
load (``sharded``), what a run saves (``train_state``), and crash-safe publication (``atomic``)."""
