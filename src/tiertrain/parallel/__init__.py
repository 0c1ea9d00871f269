"""Process groups and the collectives block groups call on their chunks. One process is the case
world = 1 of the same code (``LocalCollectives``); ``ProcessGroupCollectives`` runs them over
``torch.distributed``; ``group`` finds or starts the process group a run belongs to."""

from tiertrain.parallel.collectives import Collectives, ring_bytes
from tiertrain.parallel.group import collectives_for, rank_from_env, world_from_env
from tiertrain.parallel.local import LocalCollectives

__all__ = ["Collectives", "LocalCollectives", "collectives_for", "rank_from_env", "ring_bytes", "world_from_env"]
