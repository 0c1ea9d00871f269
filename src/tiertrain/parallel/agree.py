"""What the ranks of a run must agree on before they lay out a plan: the figures each would
otherwise measure for itself (page size, disk depth, the model's profile, the budgets it takes from
the machine).

Measured on every rank at once, those figures differ: the ranks of one host measure one disk and one
set of cores together, each disturbing the others, and the solvers, fed different profiles, can choose
different plans, whose collectives then do not match and hang. So one rank measures and the others
take its figures, or (budgets) every rank says what it has and each takes what all can.

Exchanged as JSON through the process group's key-value store, which every backend has (gloo and
NCCL alike, no tensors on any device) and which carries text, so nothing is unpickled. Why by hand:
``torch.distributed``'s object collectives pickle, and need a device the backend accepts.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from tiertrain.errors import ConfigError
from tiertrain.parallel.group import ensure_process_group, world_from_env

T = TypeVar("T")
# Measuring may take minutes (a profile, the disk's depth): the other ranks wait this long for it.
# A rank 0 that dies takes the store with it, which ends the wait at once.
WAIT = timedelta(seconds=int(os.environ.get("TIERTRAIN_MEASURE_TIMEOUT", "1800")))
_calls = itertools.count()  # every rank makes the same calls in the same order, so the n-th call's key is shared


def _store():  # noqa: ANN202 - torch's Store, imported lazily with torch.distributed
    import torch.distributed as dist

    ensure_process_group()
    return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def from_rank0(what: str, make: Callable[[], T], encode: Callable[[T], str], decode: Callable[[str], T]) -> T:
    """``make()`` on rank 0 only; every other rank waits and takes rank 0's result (``what`` names it
    in messages). One process: ``make()``. A failure on rank 0 is raised on every rank."""
    if world_from_env() == 1:
        return make()
    store, rank, _ = _store()
    key = f"tiertrain/agreed/{next(_calls)}/{what}"
    if rank == 0:
        try:
            value = make()
        except Exception as exc:
            store.set(key, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        store.set(key, json.dumps({"value": encode(value)}))
        return value
    entry = json.loads(_wait(store, key, what))
    if "error" in entry:
        raise ConfigError(f"rank 0 failed while finding {what} for every rank: {entry['error']}")
    return decode(entry["value"])


def every_rank(what: str, mine: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Every rank's ``mine``, in rank order, each with the name of the host it runs on (the ranks of
    one host share its memory and disks). One process: its own."""
    host = socket.gethostname()
    if world_from_env() == 1:
        return [(host, mine)]
    store, rank, world = _store()
    key = f"tiertrain/agreed/{next(_calls)}/{what}"
    store.set(f"{key}/{rank}", json.dumps({"host": host, "figures": list(mine)}))
    every = [json.loads(_wait(store, f"{key}/{r}", what)) for r in range(world)]
    if any(len(e["figures"]) != len(mine) for e in every):
        raise ConfigError(f"the ranks disagree on what {what} holds: run one version of tiertrain on every rank")
    return [(e["host"], tuple(int(f) for f in e["figures"])) for e in every]


def _wait(store, key: str, what: str) -> str:  # noqa: ANN001 - torch's Store
    try:
        store.wait([key], WAIT)
    except RuntimeError as exc:  # a timeout, or the store gone with rank 0
        raise ConfigError(f"waited in vain for {what} from the other ranks ({exc}); if a rank measures for long, "
                          f"raise TIERTRAIN_MEASURE_TIMEOUT (now {int(WAIT.total_seconds())} s)") from None
    return store.get(key).decode()
