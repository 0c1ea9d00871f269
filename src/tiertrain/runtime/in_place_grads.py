"""The rest's large gradients written straight into its grad chunk.

Why by hand: autograd makes a weight's gradient as a tensor of its own before any hook sees it, and
the rest's are its largest: the head's (vocab x d: 463 MB in fp32 for GPT-3 1.7B's) and the token
embedding's, dense although a step's tokens touch a few of its rows. Each lived beside the pools as
large as the rest's whole grad chunk, and the head's came while every block's activations were still
saved: the 1.7B at 2 GiB device and 1 GiB host held 3.9 GiB of RSS, and the planner counted none of it.
No PyTorch hook runs before that tensor exists, so the head's and the embedding's modules run an
autograd function of their own here:

- the head's weight gradient is the product autograd computes (``grad.t() @ input``) by the same
  ``mm``, written with ``out=`` into the chunk's view of the weight: the same bits, no tensor of its own;
- the embedding's is summed by the same ``embedding_dense_backward`` over the step's distinct tokens
  only (their order kept, so each row adds its tokens as autograd's dense sum does) and added to their
  rows; the other rows get ``+ 0.0``, as autograd's dense sum gives them.

It applies where the runtime fills the rest's chunk through backward (``Runtime._tied_grads_early``:
one process, one micro-batch, fp32, no update loop taking the chunk mid-backward); elsewhere each
function returns autograd's gradient, so training is plain PyTorch's there as here. A weight with a
hook of the user's on it (``Tensor.register_hook``) gets autograd's gradient too: the hook must see it
(and may change it). A module of another kind (a subclass, an embedding with ``max_norm``) keeps its own
forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


class GradSink(Protocol):
    """The rest's group, as these functions see it (``BlockGroup``)."""

    def in_place_target(self, index: int) -> tuple[torch.Tensor, bool] | None: ...
    def grad_written(self, index: int) -> None: ...


@dataclass(frozen=True)
class Target:
    """Parameter ``index`` of the group ``group()`` returns (the rest's, whichever plan runs): where one
    module's use of it sends its gradient."""

    group: Callable[[], GradSink]
    index: int

    def where(self, weight: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        """The view to write ``weight``'s gradient into, or None: autograd's way (``hooked``)."""
        return None if hooked(weight) else self.group().in_place_target(self.index)

    def written(self) -> None:
        self.group().grad_written(self.index)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: Target) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        ctx.target = target
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = g.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if not _accumulates(ctx, 1):
            return grad_x, None, None
        flat, grad_w = x.reshape(-1, x.shape[-1]), None
        where = ctx.target.where(weight)
        if where is not None and where[1]:  # the first gradient of it: the product is its value
            torch.mm(g.t(), flat, out=where[0])
            ctx.target.written()
        else:
            grad_w = g.t().mm(flat)
        return grad_x, grad_w, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int,  # noqa: ANN001
                target: Target) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.target, ctx.weight, ctx.padding_idx = target, weight, padding_idx
        return F.embedding(ids, weight, None if padding_idx < 0 else padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (ids,) = ctx.saved_tensors
        if not _accumulates(ctx, 1):
            return None, None, None, None
        where = ctx.target.where(ctx.weight)
        if where is None:
            rows = ctx.weight.shape[0]
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, rows, ctx.padding_idx, False), None, None
        view, first = where
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)  # order kept: the same sums per row
        pad = (rows == ctx.padding_idx).nonzero()
        summed = torch.ops.aten.embedding_dense_backward(grad, inverse, len(rows), int(pad[0, 0]) if len(pad) else -1,
                                                         False)
        if first:
            view.zero_()
            view.index_copy_(0, rows, summed)
        else:
            view.add_(0.0)  # autograd adds a dense gradient: + 0.0 where no token was (-0.0 becomes 0.0)
            view.index_add_(0, rows, summed)
        ctx.target.written()
        return None, None, None, None


def _accumulates(ctx, i: int) -> bool:  # noqa: ANN001
    """Whether this backward accumulates input ``i``'s gradient into its parameter: not under
    ``torch.autograd.grad`` or ``backward(inputs=...)`` without it (``needs_input_grad`` says only
    that it requires grad), where plain PyTorch adds nothing to ``.grad`` either."""
    node = ctx.next_functions[i][0]
    return ctx.needs_input_grad[i] and node is not None and torch._C._will_engine_execute_node(node)


def in_place_uses(model: nn.Module, params: list[nn.Parameter]) -> list[tuple[nn.Module, int]]:
    """(module, index in ``params``) of every ``handled`` module whose weight is one of ``params``."""
    index = {id(p): i for i, p in enumerate(params)}
    return [(m, index[id(m.weight)]) for m in model.modules() if handled(m) and id(m.weight) in index]


def handled(module: nn.Module) -> bool:
    """Whether its gradient can be written in place: a plain ``nn.Linear`` without a bias (a head's), or a
    plain ``nn.Embedding`` without ``max_norm``, ``scale_grad_by_freq`` or sparse gradients."""
    if type(module) is nn.Linear:
        return module.bias is None
    return type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq \
        and not module.sparse


def hooked(weight: torch.Tensor) -> bool:
    """Whether the user put a hook on ``weight``'s gradient (``Tensor.register_hook``; the runtime's own
    are post-accumulate hooks, kept apart)."""
    return bool(weight._backward_hooks)


def write_in_place(module: nn.Module, target: Target, enabled: Callable[[], bool]) -> None:
    """Run ``module`` (``handled``) through the functions above while ``enabled()`` and autograd records."""
    forward = module.forward

    def applies(x: torch.Tensor) -> bool:
        """Not where autocast casts the product (its gradient comes in another dtype than the chunk's)."""
        return (enabled() and torch.is_grad_enabled() and module.weight.requires_grad and not hooked(module.weight)
                and not torch.is_autocast_enabled(x.device.type))

    def linear(x: torch.Tensor) -> torch.Tensor:
        if not (applies(x) and x.dim() >= 2 and x.is_contiguous()):  # as F.linear folds it into one mm
            return forward(x)
        return _Linear.apply(x, module.weight, target)

    def embedding(ids: torch.Tensor) -> torch.Tensor:
        if not applies(ids):
            return forward(ids)
        pad = -1 if module.padding_idx is None else module.padding_idx
        return _Embedding.apply(ids, module.weight, pad, target)

    module.forward = linear if isinstance(module, nn.Linear) else embedding
