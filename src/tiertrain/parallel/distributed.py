"""Collectives over a ``torch.distributed`` process group: PyTorch's own engine (gloo, NCCL), called
on our flat chunks directly. Newer torch names the flat calls ``all_gather_single`` /
``reduce_scatter_single`` and deprecates ``*_into_tensor`` (torch 2.13, BENCHMARKS.md); GPU
machines run 2.11, which has only the old names, so we take whichever this torch has."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tiertrain.parallel.collectives import Waitable, ring_bytes

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _flat_call(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"this torch.distributed has none of {', '.join(names)}")


class ProcessGroupCollectives:
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.sent = 0
        self._gather = _flat_call("all_gather_single", "all_gather_into_tensor")
        self._scatter = _flat_call("reduce_scatter_single", "reduce_scatter_tensor")
        self._gloo = dist.get_backend(group) == "gloo"

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.sent += ring_bytes(kind, t.numel() * t.element_size(), self.world_size)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Waitable | None:
        self._count("all_gather", out)
        return self._gather(out.view(-1), shard.view(-1), group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        self._count("reduce_scatter", full)
        if self._gloo:
            # gloo has no reduce-scatter: all-reduce, then keep this rank's slice (the sum is the same:
            # what is sent differs, and ``sent`` counts the reduce-scatter the algorithm stands for)
            summed = full.view(-1).clone()
            dist.all_reduce(summed, group=self.group)
            n = out.numel()
            out.view(-1).copy_(summed[self.rank * n : (self.rank + 1) * n])
            return
        self._scatter(out.view(-1), full.view(-1), group=self.group)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        self._count("all_reduce", t)
        dist.all_reduce(t, op=_OPS[op], group=self.group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._count("all_to_all", inp)
        dist.all_to_all_single(out.view(-1), inp.view(-1), group=self.group)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        self._count("broadcast", t)
        dist.broadcast(t, src=src, group=self.group)
