"""A check that every collective gets a tensor of its side: device-tier memory for the device group,
host memory for the CPU group (``Collectives.host``).

On a GPU machine the device group is NCCL, which refuses a host tensor, and a device tensor given to
gloo crosses the slowest path there is. On a CPU machine every tier is host memory and both sides may
be one gloo group, so a misplaced tensor runs and trains: nothing would show the fault before a GPU
run. The memory system knows which pool a tensor lies in (``MemorySystem.tier_of``), so the check
holds each call to its side there too. It is on where ``TIERTRAIN_CHECK_COLLECTIVES=1`` (the test
suite sets it, for every rank it starts); a run pays one pointer comparison per tensor for it.

The rule per side:
  device  a view of the device pool (chunks gathered, reduced, broadcast); an all-to-all's rows are
          activations, which live beside the pool on the compute device: those must not lie in a host
          pool (on a CPU machine any other CPU tensor passes, the one place the check is weaker);
  host    CPU memory outside the device pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tiertrain.parallel.collectives import Collectives, Waitable
from tiertrain.plan.tiers import Tier

ENV = "TIERTRAIN_CHECK_COLLECTIVES"

_COMPUTE = "cuda" if torch.cuda.is_available() else "cpu"  # where activations live
TierOf = Callable[[torch.Tensor], "Tier | None"]


class MisplacedTensor(RuntimeError):
    """A collective was given a tensor of the other side: a tiertrain bug that fails on a GPU machine."""


def checking() -> bool:
    return os.environ.get(ENV, "") == "1"


class PlacementChecked:
    """``inner``'s collectives, each tensor held to ``side`` first; ``host`` checked as the host side."""

    def __init__(self, inner: Collectives, tier_of: TierOf, side: str = "device",
                 host: PlacementChecked | None = None) -> None:
        self.inner, self.tier_of, self.side = inner, tier_of, side
        self.rank, self.world_size = inner.rank, inner.world_size
        self.host = self if side == "host" else host or PlacementChecked(inner.host, tier_of, "host")

    sent = property(lambda self: self.inner.sent)
    heartbeat = property(lambda self: getattr(self.inner, "heartbeat", None))

    def _check(self, call: str, *tensors: torch.Tensor, rows: bool = False) -> None:
        for t in tensors:
            if t.numel() == 0:  # nothing moves (a shard holding no piece of a block)
                continue
            tier = self.tier_of(t)
            if self.side == "host":
                ok = t.device.type == "cpu" and tier is not Tier.DEVICE
            elif rows:
                ok = tier is not Tier.HOST and t.device.type == _COMPUTE
            else:
                ok = tier is Tier.DEVICE
            if not ok:
                where = f"the {tier.value} tier" if tier is not None else f"{t.device} memory outside the pools"
                raise MisplacedTensor(
                    f"internal: {call} on the {self.side} group was given a tensor of {tuple(t.shape)} in {where}; "
                    f"the {self.side} group takes {'device-tier' if self.side == 'device' else 'host'} memory "
                    "only (NCCL refuses host tensors): a tiertrain bug, please report it")

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Waitable | None:
        self._check("all_gather", out, shard)
        return self.inner.all_gather(out, shard, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Waitable | None:
        self._check("reduce_scatter", out, full)
        return self.inner.reduce_scatter(out, full, async_op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False) -> Waitable | None:
        self._check("all_reduce", t)
        return self.inner.all_reduce(t, op, async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        self._check("all_to_all", out, inp, rows=in_splits is not None)
        self.inner.all_to_all(out, inp, out_splits, in_splits)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        self._check("broadcast", t)
        self.inner.broadcast(t, src)

    def close(self) -> None:
        self.inner.close()


def checked(comm: Collectives, tier_of: TierOf) -> Collectives:
    """``comm`` held to its sides where the check is on (``TIERTRAIN_CHECK_COLLECTIVES=1``), else itself."""
    return PlacementChecked(comm, tier_of) if checking() and not isinstance(comm, PlacementChecked) else comm


def checked_like(world: Collectives, comm: Collectives) -> Collectives:
    """A subgroup's collectives checked as the run's are (expert parallel's groups)."""
    if isinstance(world, PlacementChecked):
        return PlacementChecked(comm, world.tier_of)
    return comm
