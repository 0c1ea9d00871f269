"""Collectives over a ``torch.distributed`` process group: PyTorch's own engine (gloo, NCCL), called
on our flat chunks directly. Newer torch names the flat calls ``all_gather_single`` /
``reduce_scatter_single`` and deprecates ``*_into_tensor`` (torch 2.13, BENCHMARKS.md); GPU
machines run 2.11, which has only the old names, so we take whichever this torch has."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tiertrain.parallel.collectives import Waitable, ring_bytes, split_bytes
from tiertrain.parallel.health import Heartbeat, failure

if TYPE_CHECKING:
    from tiertrain.parallel.mesh import MeshDim

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _flat_call(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"this torch.distributed has none of {', '.join(names)}")


class ProcessGroupCollectives:
    """Every call turns a peer's loss into one ``RankLost`` that names it, and any other failure into
    ``CollectiveFailed`` in the backend's words (``parallel.health.failure``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, heartbeat: Heartbeat | None = None,
                 host_group: dist.ProcessGroup | None = None) -> None:
        """``group``: None for the whole run's ranks; a subgroup (expert parallel's) shares the run's
        ``heartbeat``, which names the run's ranks. ``host_group``: a gloo group of the same ranks for
        host tensors, where ``group`` is not gloo (a subgroup's, made by every rank as ``new_group``
        requires); None for the whole run makes one here (every rank constructs the run's alike)."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.sent = 0
        self.place: MeshDim | None = None  # where a mesh's group lies in it (``parallel.mesh``: split again there)
        self.made: list[dist.ProcessGroup] = []  # the groups a mesh made with it, destroyed when it closes
        self._own_heartbeat = heartbeat is None
        self.heartbeat = heartbeat or Heartbeat(dist.distributed_c10d._get_default_store(), self.rank, self.world_size)
        self._gather = _flat_call("all_gather_single", "all_gather_into_tensor")
        self._scatter = _flat_call("reduce_scatter_single", "reduce_scatter_tensor")
        self._gloo = dist.get_backend(group) == "gloo"
        self.host = self if self._gloo else self._host_side(host_group)

    def _host_side(self, host_group: dist.ProcessGroup | None) -> ProcessGroupCollectives:
        """The same ranks over gloo: NCCL refuses host tensors (flags, counts, norms, setup's and
        checkpoints' transfers go there)."""
        if host_group is None:
            if self.group is not None:
                raise ValueError("internal: a subgroup's host group is made with it, by every rank")
            host_group = dist.new_group(backend="gloo")
        return ProcessGroupCollectives(host_group, heartbeat=self.heartbeat)

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.sent += ring_bytes(kind, t.numel() * t.element_size(), self.world_size)

    def _guarded(self, name: str, call, *args, **kwargs):
        """``call(*args, **kwargs)``, the collective ``name``, its failure reported as ``failure`` says."""
        try:
            return call(*args, **kwargs)
        except RuntimeError as exc:  # gloo and NCCL report a lost peer as RuntimeError (DistBackendError is one)
            raise failure(self.heartbeat, exc, name) from None

    def close(self) -> None:
        """Its heartbeat stopped where it is its own, and the groups a mesh made with it destroyed (once)."""
        if self._own_heartbeat:
            self.heartbeat.close()
        made, self.made = self.made, []
        for group in made:
            try:
                if dist.get_backend(group) != "gloo":  # NCCL's teardown waits for every member, which a lost
                    continue                           # rank never gives: the process's end lets them go
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already gone (the run's end destroyed every group)
                continue

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Waitable | None:
        self._count("all_gather", out)
        work = self._guarded("all_gather", self._gather, out.view(-1), shard.view(-1), group=self.group, async_op=async_op)
        return _Guarded(work, self, "all_gather") if async_op else None

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Waitable | None:
        self._count("reduce_scatter", full)
        if self._gloo:
            # gloo has no reduce-scatter: all-reduce in place (``full`` is the caller's to give up), then
            # keep this rank's slice (the sum is the same: what is sent differs, and ``sent`` counts the
            # reduce-scatter the algorithm stands for)
            work = self._guarded("reduce_scatter", dist.all_reduce, full.view(-1), group=self.group, async_op=async_op)
            n = out.numel()
            keep = _Then(lambda: out.view(-1).copy_(full.view(-1)[self.rank * n : (self.rank + 1) * n]))
            if not async_op:
                keep.wait()
                return None
            return _Guarded(work, self, "reduce_scatter", keep)
        work = self._guarded("reduce_scatter", self._scatter, out.view(-1), full.view(-1), group=self.group, async_op=async_op)
        return _Guarded(work, self, "reduce_scatter") if async_op else None

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False) -> Waitable | None:
        self._count("all_reduce", t)
        work = self._guarded("all_reduce", dist.all_reduce, t, op=_OPS[op], group=self.group, async_op=async_op)
        return _Guarded(work, self, "all_reduce") if async_op else None

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        if in_splits is None:
            self._count("all_to_all", inp)
            self._guarded("all_to_all", dist.all_to_all_single, out.view(-1), inp.view(-1), group=self.group)
            return
        self.sent += split_bytes(inp, in_splits, self.rank)
        self._guarded("all_to_all", dist.all_to_all_single, out, inp, out_splits, in_splits, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        self._count("broadcast", t)
        root = src if self.group is None else dist.get_global_rank(self.group, src)  # torch names roots globally
        self._guarded("broadcast", dist.broadcast, t, src=root, group=self.group)


class _Then:
    """What is left to do once a collective has landed (a local copy), done once."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn: Callable[[], object] | None = fn

    def wait(self) -> None:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            fn()


class _Guarded:
    """An asynchronous collective whose ``wait`` names a lost peer as the call itself would, then
    does what is left (``then``)."""

    def __init__(self, work, comm: ProcessGroupCollectives, name: str, then: _Then | None = None) -> None:
        self.work, self.comm, self.name, self.then = work, comm, name, then

    def wait(self) -> None:
        self.comm._guarded(self.name, self.work.wait)
        if self.then is not None:
            self.then.wait()
