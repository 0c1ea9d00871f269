"""Hybrid sharding (FSDP2's HSDP, ZeRO++'s hpZ): a sharded block split over a group of ranks inside a
node and replicated across the nodes, so that what crosses the slow links between nodes is each
shard's gradient all-reduce, never a gather of compute params.

``HybridCollectives`` is what a sharded block group calls: it looks like one group of the shard
group's size (its ``rank`` picks the shard), gathers inside the shard group, and reduces a block's
gradients in two steps: reduce-scatter inside the shard group, then all-reduce of the shard across
the replicas (the part a rank keeps is the sum over every rank). Per step a rank sends, for a block
of B bytes of gradients in a mesh of R groups of S ranks: (S-1)/S x B inside its group and
2 (R-1)/R x B/S across groups, against 2 (N-1)/N x B over one flat ring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiertrain.parallel.collectives import Collectives, Waitable
from tiertrain.parallel.mesh import mesh_collectives
from tiertrain.plan.parallel import ParallelLayout


class HybridCollectives:
    """A sharded block's collectives over ``shard`` (this rank's group) and ``replicas`` (the ranks of
    the other groups holding the same shard)."""

    def __init__(self, shard: Collectives, replicas: Collectives) -> None:
        self.shard, self.replicas = shard, replicas
        self.rank, self.world_size = shard.rank, shard.world_size  # the shards: what a layout is split into
        one_side = shard.host is shard and replicas.host is replicas
        self.host = self if one_side else HybridCollectives(shard.host, replicas.host)

    @property
    def sent(self) -> int:
        return self.shard.sent + self.replicas.sent

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Waitable | None:
        return self.shard.all_gather(out, shard, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Waitable | None:
        """The shard group's reduce-scatter, then (once it has landed) the replicas' all-reduce of ``out``:
        issued from the waiting thread, which every rank reaches in the same order."""
        first = self.shard.reduce_scatter(out, full, async_op)
        return self._then_across(first, async_op, lambda a: self.replicas.all_reduce(out, async_op=a))

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False) -> Waitable | None:
        """Over every rank of the mesh: inside the group, then across."""
        first = self.shard.all_reduce(t, op, async_op)
        return self._then_across(first, async_op, lambda a: self.replicas.all_reduce(t, op, async_op=a))

    @staticmethod
    def _then_across(first: Waitable | None, async_op: bool,
                     across: Callable[[bool], Waitable | None]) -> Waitable | None:
        """``first`` (inside the group; done unless ``async_op``), then ``across(async_op)`` over the replicas:
        at once, or chained for the runtime to start (``Chained.advance``)."""
        if not async_op:
            across(False)
            return None
        return Chained(first, lambda: across(True))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        raise NotImplementedError("internal: a sharded block exchanges no rows (expert parallel has its own groups)")

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Rank 0 of the mesh's ``t`` everywhere (``src`` 0 only): down its column, then along each row."""
        if src != 0:
            raise ValueError("internal: a hybrid broadcast starts at the mesh's rank 0")
        self.replicas.broadcast(t, 0)
        self.shard.broadcast(t, 0)

    def close(self) -> None:
        """The groups its mesh made (they share the run's heartbeat, which the run's collectives close)."""
        self.shard.close()
        self.replicas.close()


class Chained:
    """A collective in flight, then another started once it has landed: by ``advance`` (the runtime calls
    it at a point every rank reaches in one order: ``BackwardPass.reduction_started``, so the second runs
    under the next block's backward), else by ``wait``. A failure raises at every later call: the
    second is never issued twice, nor after the first failed."""

    def __init__(self, first: Waitable | None, then: Callable[[], Waitable | None]) -> None:
        self._first, self._then = first, then
        self._second: Waitable | None = None
        self._error: BaseException | None = None

    def advance(self) -> None:
        """Wait for the first; start the second without waiting for it (once)."""
        if self._error is not None:
            raise self._error
        if self._then is None:
            return
        then, self._then = self._then, None
        try:
            if self._first is not None:
                self._first.wait()
            self._second = then()
        except BaseException as exc:
            self._error = exc
            raise

    def wait(self) -> None:
        self.advance()
        second, self._second = self._second, None
        if second is not None:
            second.wait()


def sharded_collectives(world: Collectives, layout: ParallelLayout) -> Collectives:
    """What the run's sharded blocks are laid out over: the run's ranks, or with hybrid sharding a
    replicate x shard mesh of them (every rank makes it, in one order)."""
    if not layout.hybrid:
        return world
    shard, replicas = mesh_collectives(world, layout.dp // layout.shard_group, layout.shard_group,
                                       ("replicate", "shard"))
    return HybridCollectives(shard, replicas)


def distinct_over(shards: Collectives) -> Collectives:
    """The ranks over which the sharded blocks' shards differ (a global norm sums their squares there):
    the shard group of a hybrid layout, else every rank."""
    return shards.shard if isinstance(shards, HybridCollectives) else shards
