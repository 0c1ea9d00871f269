"""Megatron's two conjugate operators of tensor parallel (Shoeybi et al. 2019, §3): where a block enters
its sharded region (``f``: identity forward, the gradients' sum over the group backward) and where it
leaves it (``g``: the partial outputs' sum forward, identity backward).

Why ours and not DTensor's (``torch.distributed.tensor.parallel``): ColwiseParallel and RowwiseParallel
make every sharded weight a DTensor, and the tiers replace a parameter's storage with a slot of the device
pool (``runtime.slots``: ``Tensor.set_`` onto the pool, grads moved as plain tensors into chunks). A
DTensor's local tensor lives behind its wrapper: its storage, its version counter and its ``.grad`` are
the wrapper's, so every tier move would go through DTensor's dispatch. Plain parameters holding each
rank's shard run through the tiers unchanged (streaming, recompute, offloaded and lock-free updates);
the two operators below are all DTensor would add to their forward and backward, and fused qkv needs a
head-aware cut that ColwiseParallel does not make anyway (``parallel.tensor_layers``).
"""

from __future__ import annotations

from typing import Any

import torch

from tiertrain.parallel.collectives import Collectives


class _EnterRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Collectives) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's buffer is not the group's to write
        ctx.group.all_reduce(grad)
        return grad, None


class _LeaveRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Collectives) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def enter_region(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """``x`` as every rank of ``group`` holds it, entering column-parallel weights: its gradient is the sum
    of the ranks' (each rank's shard of the weights gives part of it)."""
    return _EnterRegion.apply(x, group)


def leave_region(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """The sum over ``group`` of each rank's partial ``x`` (row-parallel weights' outputs): every rank then
    holds the whole, and the gradient of each partial is the gradient of the whole."""
    return _LeaveRegion.apply(x, group)
