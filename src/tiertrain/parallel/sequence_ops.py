"""Sequence parallel's operators (Korthikanti et al. 2022, §4.2.2: Megatron's sequence parallelism): between
a tensor-parallel group's cut regions, each rank holds its slice of the sequence, so the norms, residual
adds and what they keep for backward are 1/T of the whole on each rank.

``enter_sequence``/``leave_sequence`` take the places of tensor parallel's ``f``/``g``
(``parallel.tensor_ops``): a region is entered by gathering the sequence (its gradient reduce-scattered
back to the slices) and left by reduce-scattering the partial outputs (their gradient gathered), the
same bytes as the all-reduces they replace. ``scatter_sequence`` hands each rank its slice of a whole
tensor (the embeddings' output; the gradients of the slices gathered), ``gather_sequence`` puts the
slices together again for what follows the blocks whole on every rank (every rank's gradient of the
whole is the same, so backward keeps the rank's slice). Tensors are [batch, sequence, ...]; the sequence
must divide by the group's size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiertrain.errors import ConfigError
from tiertrain.parallel.collectives import Collectives


def _gather(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """The whole sequence from every rank's slice of it (dim 1), in rank order."""
    part = x.transpose(0, 1).contiguous()
    out = part.new_empty((part.shape[0] * group.world_size, *part.shape[1:]))
    group.all_gather(out, part)
    return out.transpose(0, 1)


def _reduce_scatter(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """This rank's slice (dim 1) of the sum over the group of every rank's whole ``x``."""
    full = x.transpose(0, 1).clone(memory_format=torch.contiguous_format)  # a copy: the group may write into it
    out = full.new_empty((full.shape[0] // group.world_size, *full.shape[1:]))
    group.reduce_scatter(out, full)
    return out.transpose(0, 1)


def _slice(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """This rank's slice of the sequence (dim 1) of ``x``, a tensor of its own."""
    n = x.shape[1] // group.world_size
    return x[:, group.rank * n:(group.rank + 1) * n].contiguous()


Op = Callable[[torch.Tensor, Collectives], torch.Tensor]


def _conjugate(name: str, forward: Op, backward: Op) -> type[torch.autograd.Function]:
    """An autograd function doing ``forward`` over the group, and ``backward`` to its gradient."""
    def fwd(ctx: Any, x: torch.Tensor, group: Collectives) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_Scatter = _conjugate("_Scatter", _slice, _gather)
_Gather = _conjugate("_Gather", _gather, _slice)
_Enter = _conjugate("_Enter", _gather, _reduce_scatter)
_Leave = _conjugate("_Leave", _reduce_scatter, _gather)


def scatter_sequence(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """This rank's slice of the sequence of ``x`` (whole and alike on every rank of ``group``)."""
    if x.shape[1] % group.world_size:
        raise ConfigError(f"sequence parallel over {group.world_size} ranks needs a sequence length they divide; got "
                          f"{x.shape[1]}: feed sequences whose length {group.world_size} divides (generate with the "
                          "model cut without sequence parallel)")
    return _Scatter.apply(x, group)


def gather_sequence(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """The whole sequence on every rank of ``group`` from each rank's slice."""
    return _Gather.apply(x, group)


class Gathered:
    """The slice a whole sequence was gathered from, for the column-parallel layers reading the whole: they
    save the slice for backward, not the whole (Korthikanti et al. 2022, §4.2.2: Megatron gathers it again
    in backward), and the first of them to need the whole in backward gathers it for all of them."""

    def __init__(self, group: Collectives) -> None:
        self.group, self.readers, self._whole = group, 0, None

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        """The whole sequence again, from the slice ``part`` a reader saved; let go after its last reader."""
        whole = self._whole if self._whole is not None else _gather(part, self.group).contiguous()
        self.readers -= 1
        self._whole = whole if self.readers > 0 else None
        return whole


def enter_sequence(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """``enter_region`` for a rank's sequence slice: the whole sequence in, its gradient summed into slices.
    The whole carries ``gathered_from`` (the slice, and a ``Gathered``) for the column layers reading it."""
    whole = _Enter.apply(x, group)
    whole.gathered_from = (x, Gathered(group))
    return whole


def leave_sequence(x: torch.Tensor, group: Collectives) -> torch.Tensor:
    """``leave_region`` into sequence slices: the partial outputs' sum, each rank its slice of it."""
    return _Leave.apply(x, group)


def sum_whole_gradients(model: nn.Module, whole: Callable[[str], bool], group: Collectives) -> None:
    """Each whole parameter of ``model``'s blocks (``whole`` of its name: norms, row-parallel biases) gets
    its gradient summed over ``group`` before it is accumulated: under sequence parallel each rank's is its
    slice of the tokens' part, and every rank must update with the whole. On the parameters the loop
    trains (the tiered module's, after setup)."""
    for name, p in model.named_parameters():
        if whole(name):
            p.register_hook(_summed(group))


def _summed(group: Collectives) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)  # autograd's buffer is not the group's to write
        group.all_reduce(total)
        return total
    return hook
