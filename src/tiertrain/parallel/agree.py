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

Keys: ``what`` and how many times this process group has agreed on it before. Every rank calls in
for the same things in the same order whatever its own settings (a rank decides nothing locally
first), so the keys match.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from tiertrain.errors import ConfigError
from tiertrain.parallel.group import ensure_process_group, world_from_env

T = TypeVar("T")
DEFAULT_WAIT_S = 1800  # measuring may take minutes (a profile, the disk's depth): the others wait this long
SAY_AFTER_S = 2.0      # a rank still waiting after this long says what for (an exchange is over sooner)


def _group() -> tuple[Any, int, int] | None:
    """(store, rank, world size) of the run's process group, or None where this process runs alone
    (or has no group and no torchrun environment to start one: ``tiertrain plan`` in a shell that
    exported WORLD_SIZE measures for itself)."""
    import torch.distributed as dist

    if world_from_env() == 1 or not (dist.is_initialized() or "MASTER_ADDR" in os.environ):
        return None
    ensure_process_group()
    return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def _key(store: Any, rank: int, what: str) -> str:
    """The n-th exchange about ``what`` in this process group: counted in the group's own store, per
    rank (a new group starts at 1; nothing is kept in this process, which may outlive the group)."""
    return f"tiertrain/agreed/{what}/{store.add(f'tiertrain/agreed/{what}/count/{rank}', 1)}"


def from_rank0(what: str, make: Callable[[], T], encode: Callable[[T], str], decode: Callable[[str], T]) -> T:
    """``make()`` on rank 0 only; every other rank waits and takes rank 0's result (``what`` names it
    in messages). One process: ``make()``. A failure on rank 0 (making or encoding) is raised on
    every rank."""
    group = _group()
    if group is None:
        return make()
    store, rank, _ = group
    key = _key(store, rank, what)
    if rank == 0:
        try:
            value = make()
            text = encode(value)
        except Exception as exc:
            store.set(key, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        store.set(key, json.dumps({"value": text}))
        return value
    entry = json.loads(_wait(store, key, what, rank))
    if "error" in entry:
        raise ConfigError(f"rank 0 failed while finding {what} for every rank: {entry['error']}")
    return decode(entry["value"])


def every_rank(what: str, mine: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Every rank's ``mine``, in rank order, each with the name of the host it runs on (the ranks of
    one host share its memory and disks). One process: its own."""
    host = socket.gethostname()
    group = _group()
    if group is None:
        return [(host, mine)]
    store, rank, world = group
    key = _key(store, rank, what)
    store.set(f"{key}/{rank}", json.dumps({"host": host, "figures": list(mine)}))
    every = [json.loads(_wait(store, f"{key}/{r}", what, rank)) for r in range(world)]
    if any(len(e["figures"]) != len(mine) for e in every):
        raise ConfigError(f"the ranks disagree on what {what} holds: run one version of tiertrain on every rank")
    return [(e["host"], tuple(int(f) for f in e["figures"])) for e in every]


def _wait(store: Any, key: str, what: str, rank: int) -> str:
    """The value at ``key`` once a rank has set it, saying what this rank waits for where it is not
    there within ``SAY_AFTER_S``. The store is rank 0's (it ends with it) or torchrun's agent's (which ends every rank
    when one fails), so only a rank that is alive and slow, or stuck, keeps the others here."""
    limit = _wait_limit()
    quiet_until = time.monotonic() + SAY_AFTER_S
    try:
        while not store.check([key]):
            if time.monotonic() > quiet_until:
                print(f"tiertrain: rank {rank} waiting for {what} from the other ranks (up to {limit} s)...",
                      file=sys.stderr, flush=True)
                store.wait([key], timedelta(seconds=limit))
                break
            time.sleep(0.02)
        return store.get(key).decode()
    except RuntimeError as exc:  # the timeout, or the store gone
        raise ConfigError(f"rank {rank} waited in vain for {what} from the other ranks ({exc}); if a rank "
                          f"measures for long, raise TIERTRAIN_MEASURE_TIMEOUT (now {limit} s)") from None


def _wait_limit() -> int:
    given = os.environ.get("TIERTRAIN_MEASURE_TIMEOUT", str(DEFAULT_WAIT_S))
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"TIERTRAIN_MEASURE_TIMEOUT={given!r} must be a whole number of seconds, 1 or more")
    return int(given)


def same_on_every_rank(what: str, mine: dict[str, str], fix: str, ranks: list[int] | None = None) -> None:
    """Refuse, on every rank alike, a run whose ranks hold different values for any of ``mine``'s fields
    (in rank 0's order: the first that differs is named, with each rank's value where it is short; a field
    a rank lacks, another version of tiertrain, differs too). Ranks that
    disagree on what they train would issue different collectives: a hang, or a mismatch read as a
    lost rank. One process: nothing to compare. ``ranks``: the run's ranks that compare (a pipeline
    stage's data-parallel group: the other stages hold other parts of the model); None: all of them."""
    group = _group()
    if group is None:
        return
    store, rank, world = group
    among = list(range(world)) if ranks is None else ranks
    if among != list(range(world)):  # a subgroup's exchange under keys of its own
        what = f"{what} (ranks {', '.join(map(str, ranks))})"
    key = _key(store, rank, what)
    store.set(f"{key}/{rank}", json.dumps(mine))
    every = [json.loads(_wait(store, f"{key}/{r}", what, rank)) for r in among]
    names = list(dict.fromkeys(n for e in every for n in e))  # every rank's fields: each rank finds the same one
    for name in names:
        values = [e.get(name) for e in every]
        if len(set(values)) > 1:
            raise ConfigError(f"the ranks disagree on {name} ({_by_rank(values, among)}): {fix}")


def _by_rank(values: list[str | None], ranks: list[int]) -> str:
    """'rank 0: 1; rank 1: 2', or which ranks hold which value where a value is long (a plan's blocks)."""
    if all(v is not None and len(v) <= 40 for v in values):
        return "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, values))
    groups = [[r for r, v in zip(ranks, values) if v == k] for k in dict.fromkeys(values)]
    if len(groups) == 2:
        return f"{_ranks(groups[0])} one value, {_ranks(groups[1])} another"
    return "ranks by value: " + " | ".join(", ".join(map(str, g)) for g in groups)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} holds" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} hold"
