"""The collectives a block group calls on its chunks, behind one interface.

Flat-tensor calls, as FSDP2's default collectives are: a chunk is already one flat buffer padded
to a multiple of the group size (``ChunkLayout.shard_numel``), so all-gather and reduce-scatter
move it whole, with no per-parameter packing. ``local`` is the one-process case (world 1), where
every collective is the identity; ``distributed`` runs them over a ``torch.distributed`` process
group (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Collectives(Protocol):
    rank: int
    world_size: int

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out`` (world_size x shard's numel) receives every rank's ``shard``, in rank order."""

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` receives this rank's slice of the sum over ranks of ``full``."""

    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` becomes the sum over ranks of ``t``, in place."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Slice ``r`` of ``inp`` goes to rank ``r``; slice ``r`` of ``out`` comes from rank ``r``."""
