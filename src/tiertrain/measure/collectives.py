"""This machine's collective rates for ``tiertrain plan --nproc N``: N local ranks (gloo, one
thread each, as ``tiertrain train --nproc`` runs them) time all-gather, reduce-scatter,
all-reduce and all-to-all on a tensor of the runtime's chunk size; a rate is the bytes a rank
sends (the ring formulas ``parallel.collectives`` counts by) over the seconds the call took. The
calls are the runtime's own (``parallel.distributed``): over gloo, which has no reduce-scatter,
that one is an all-reduce, and its rate is what the runtime gets (half an all-reduce's).

Ranks are started as torchrun would, but in-process through ``torch.multiprocessing`` with a file
rendezvous in a private temporary directory: planning needs no launcher, and nothing is left
behind (the directory goes with the measurement).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiertrain.errors import ConfigError
from tiertrain.planner.network import Network

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
MIN_BYTES, MAX_BYTES = 1 << 20, 64 << 20   # the chunk size measured is the largest block's, within these
SECONDS = 0.3                               # per collective, after one warm-up call


def measure_network(dp: int, chunk_bytes: int) -> Network:
    """Each collective's rate over ``dp`` local ranks at ``chunk_bytes`` (clamped to 1-64 MiB)."""
    import torch.multiprocessing as mp

    if dp < 2:
        raise ConfigError("--nproc must be at least 2 to measure collectives between ranks")
    nbytes = min(max(chunk_bytes, MIN_BYTES), MAX_BYTES)
    nbytes -= nbytes % (4 * dp)  # whole float32 shards
    print(f"measuring collectives over {dp} local ranks at {nbytes / 2**20:.1f} MiB...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="tiertrain-collectives-") as tmp:
        out = Path(tmp) / "rates.json"
        mp.start_processes(_rank, args=(dp, tmp, nbytes, str(out)), nprocs=dp, join=True, start_method="spawn")
        rates = json.loads(out.read_text())
    return Network(dp, True, *(rates[k] for k in KINDS), source=f"measured here over {dp} local gloo ranks "
                                                                   f"at {nbytes / 2**20:.1f} MiB")


def _rank(rank: int, dp: int, tmp: str, nbytes: int, out: str) -> None:
    """One rank: each collective timed through the calls the runtime makes (``parallel.distributed``)."""
    import torch
    import torch.distributed as dist

    from tiertrain.parallel.collectives import ring_bytes
    from tiertrain.parallel.distributed import ProcessGroupCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=dp)
    comm = ProcessGroupCollectives()
    try:
        # zeros: gloo's reduce-scatter is an in-place all-reduce, and repeated sums of zeros stay finite
        whole, other = torch.zeros(nbytes // 4), torch.empty(nbytes // 4)
        part = torch.zeros(nbytes // 4 // dp)
        calls = {"all_gather": lambda: comm.all_gather(whole, part),
                 "reduce_scatter": lambda: comm.reduce_scatter(part, whole),
                 "all_reduce": lambda: comm.all_reduce(whole),
                 "all_to_all": lambda: comm.all_to_all(other, whole)}
        rates = {k: ring_bytes(k, nbytes, dp) / _seconds(calls[k], dist) for k in KINDS}
        if rank == 0:
            Path(out).write_text(json.dumps(rates))
    finally:
        comm.close()
        dist.destroy_process_group()


def _seconds(call: Callable[[], object], dist: Any) -> float:
    """Seconds one call takes: a warm-up call sets how many fill about ``SECONDS`` (every rank takes the
    largest count, so all make the same calls), and only those are timed."""
    import torch

    t0 = time.perf_counter()
    call()
    n = torch.tensor([max(3, int(SECONDS / max(time.perf_counter() - t0, 1e-6)))])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(n.item())):
        call()
    return (time.perf_counter() - start) / int(n.item())


def network_for(dp: int, machine_links: tuple, machine_name: str, chunk_bytes: int, node_ranks: int = 0) -> Network:
    """``plan --nproc``'s network: a described machine's first link (every collective at its rate; with
    ``node_ranks`` < dp, the ranks of a node, its second link between nodes), or this machine measured
    (``machine_links`` None: one node)."""
    nodes = 0 < node_ranks < dp
    if nodes and dp % node_ranks:
        raise ConfigError(f"--nproc-per-node {node_ranks} does not divide --nproc {dp} into whole nodes")
    if machine_links is None:
        if nodes:
            raise ConfigError("planning over several nodes takes their links from a machine description: give "
                              "--machine NAME_OR_FILE whose network lists the link inside a node, then the one "
                              "between nodes (this machine's collectives are measured between its own ranks only)")
        return measure_network(dp, chunk_bytes)
    if not machine_links:
        raise ConfigError(f"machine {machine_name} describes no network link; add one to its description "
                          '("network": [{"name": "ib0", "bps": 25e9}]) to plan over ranks')
    if nodes and len(machine_links) < 2:
        raise ConfigError(f"machine {machine_name} describes one network link; add the link between nodes as its "
                          'second ("network": [{"name": "nvlink", "bps": 450e9}, {"name": "ib0", "bps": 50e9}]) to '
                          "plan over nodes")
    link = machine_links[0]
    net = Network.from_link(dp, link.bps, f"{machine_name}'s link {link.name}, {link.bps / 1e9:.1f} GB/s (described)")
    if not nodes:
        return net
    inter = machine_links[1]
    return dataclasses.replace(net, node_ranks=node_ranks, across_bps=inter.bps,
                               source=f"{net.source} inside each node of {node_ranks} ranks, {inter.name} "
                                      f"{inter.bps / 1e9:.1f} GB/s between the {dp // node_ranks} nodes")


