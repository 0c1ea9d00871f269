"""Linear layers whose weights are one rank's shard of a tensor-parallel group, and the rule that cuts a
whole weight into shards and puts the shards back together (``Split``): the same rule cuts a model for a
run and reshards a checkpoint across group sizes.

Column-parallel (Megatron's A in ``Y = GeLU(XA)``): the output features are split; each rank computes its
columns of the output from the whole input. Row-parallel (B in ``Z = YB``): the input features are split;
each rank's output is a partial sum, summed over the group before the bias is added (once, not per rank).
Both keep ``weight`` and ``bias`` as their parameters' names, so a parameter's name in a cut model is its
name in the whole one, and its layout: torch's [out, in], or [in, out] where the whole layer kept it so
(``transposed``: GPT-2's Conv1D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.sequence_ops import leave_sequence
from tiertrain.parallel.tensor_ops import enter_region, leave_region


@dataclass(frozen=True)
class Split:
    """How a tensor is cut over a tensor-parallel group: along ``dim`` into equal slices; a fused tensor
    (q, k and v in one weight: ``parts`` = 3) has each of its parts cut alike, so every rank holds whole
    heads of all three."""

    dim: int
    parts: int = 1

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (a new contiguous tensor)."""
        pieces = full.chunk(self.parts, self.dim)
        return torch.cat([p.chunk(size, self.dim)[rank] for p in pieces], self.dim).contiguous()

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's shard, in rank order (the inverse of ``shard``)."""
        per_rank = [s.chunk(self.parts, self.dim) for s in shards]
        return torch.cat([piece[k] for k in range(self.parts) for piece in per_rank], self.dim)


class ColumnParallelLinear(nn.Module):
    """``y_r = x W_r^T + b_r``: this rank's output features of a linear layer, from the whole input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Collectives,
                 enters: bool = True, transposed: bool = False) -> None:
        """``enters``: the layer enters its input into the cut region itself (False: its module's pre-hook
        entered it once for every layer reading it, or gathered its sequence slices: sequence parallel)."""
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.enters, self.transposed = group, enters, transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.group) if self.enters else x
        weight = self.weight.t() if self.transposed else self.weight
        if getattr(x, "gathered_from", None) is not None and torch.is_grad_enabled():
            part, gathered = x.gathered_from  # sequence parallel: keep the slice for backward, not the whole
            gathered.readers += 1
            return _LinearOfGathered.apply(x, part, weight, self.bias, gathered)
        return F.linear(x, weight, self.bias)



class _LinearOfGathered(torch.autograd.Function):
    """``F.linear`` of a whole sequence gathered from ``part``, saving ``part`` for backward and gathering
    the whole from it again there (``sequence_ops.Gathered``): autograd's linear would save the whole.
    Written by hand because no torch layer takes its saved input from elsewhere; its gradients are
    ``F.linear``'s, summed in the same order. A recomputed block gathers the sequence for its recompute and
    again here: torch's checkpoint holds the recompute to the forward's saved tensors, and the original
    node cannot reach the recompute's whole. Under autocast the slice is saved (and gathered again) in the
    dtype the product ran in, as autocast's ``F.linear`` saves its input cast, and each gradient is cast
    back to its input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                gathered: Any) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        ctx.save_for_backward(part.to(out.dtype), weight)
        ctx.gathered, ctx.dtypes = gathered, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        part, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        x = ctx.gathered.whole(part)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t().mm(x.reshape(-1, x.shape[-1])).to(w_dtype)
        grad_b = None if b_dtype is None else flat.sum(0).to(b_dtype)
        return grad.matmul(weight.to(grad.dtype)).to(x_dtype), None, grad_w, grad_b, None


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: a linear layer's output from this rank's slice of its input features;
    the bias (whole on every rank) added after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Collectives,
                 transposed: bool = False, sequence: bool = False) -> None:
        """``sequence``: its output is left as this rank's slice of the sequence (sequence parallel)."""
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.transposed, self.sequence = group, transposed, sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leave = leave_sequence if self.sequence else leave_region
        y = leave(F.linear(x, self.weight.t() if self.transposed else self.weight), self.group)
        return y if self.bias is None else y + self.bias


def column_parallel(linear: nn.Module, split: Split, rank: int, group: Collectives, enters: bool = True,
                    transposed: bool = False) -> ColumnParallelLinear:
    """``linear`` cut by output features (``split``; its bias alike), this rank's shard."""
    size = group.world_size
    bias = None if linear.bias is None else Split(0, split.parts).shard(linear.bias.detach(), rank, size)
    return ColumnParallelLinear(split.shard(linear.weight.detach(), rank, size), bias, group, enters, transposed)


def row_parallel(linear: nn.Module, split: Split, rank: int, group: Collectives,
                 transposed: bool = False, sequence: bool = False) -> RowParallelLinear:
    """``linear`` cut by input features (``split``), this rank's shard; the bias kept whole."""
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(split.shard(linear.weight.detach(), rank, group.world_size), bias, group, transposed,
                             sequence)


ROWS = Split(1)   # a row-parallel weight: its input features (dim 1 of torch's [out, in])
COLUMNS = Split(0)  # a column-parallel weight or bias: its output features


def tensor_rank(module: nn.Module) -> tuple[int, int]:
    """(this rank's place in its tensor-parallel group, the group's size) of a model cut by one; (0, 1) for
    a whole model."""
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            return m.group.rank, m.group.world_size
    return 0, 1
