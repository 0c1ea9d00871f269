"""Collectives over a ``torch.distributed`` process group: PyTorch's own engine (gloo, NCCL), called
on our flat chunks directly. Newer torch names the flat calls ``all_gather_single`` /
``reduce_scatter_single`` and deprecates ``*_into_tensor`` (torch 2.13, BENCHMARKS.md); GPU
machines run 2.11, which has only the old names, so we take whichever this torch has."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
        self._gather = _flat_call("all_gather_single", "all_gather_into_tensor")
        self._scatter = _flat_call("reduce_scatter_single", "reduce_scatter_tensor")

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        self._gather(out.view(-1), shard.view(-1), group=self.group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        if full.device.type == "cpu" and dist.get_backend(self.group) == "gloo":
            # gloo has no reduce-scatter: all-reduce, then keep this rank's slice
            summed = full.view(-1).clone()
            dist.all_reduce(summed, group=self.group)
            n = out.numel()
            out.view(-1).copy_(summed[self.rank * n : (self.rank + 1) * n])
            return
        self._scatter(out.view(-1), full.view(-1), group=self.group)

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_to_all_single(out.view(-1), inp.view(-1), group=self.group)
