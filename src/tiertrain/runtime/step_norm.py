"""A step's global gradient norm, its clip coefficient and the fp16 overflow check: what the update
mode multiplies every gradient by, computed over the groups' gradient chunks.

In one process, and over ranks that each hold every gradient (replicated blocks: DDP's layout), the norm
is plain PyTorch's (``clip_grad_norm_``'s own kernel over views of the chunks, in ``model.parameters()``
order: the same bits). With sharded blocks, their pieces are summed over the ranks (another order than
torch's per-parameter norms: equal within rounding, not bit for bit), and expert parallel's held
experts' over the ranks of their expert group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiertrain.optim import clip_coefficient, total_norm
from tiertrain.parallel import Collectives
from tiertrain.parallel.experts import ExpertParallel
from tiertrain.parallel.norm import sharded_norm
from tiertrain.runtime.loss_scale import LossScaler
from tiertrain.runtime.step_clock import StepClock

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup


class StepNorm:
    def __init__(self, groups: list["BlockGroup"], order: list[tuple["BlockGroup", int]], comm: Collectives,
                 experts: ExpertParallel | None, scaler: LossScaler | None, clock: StepClock) -> None:
        """``order``: (group, parameter index) of every parameter in ``model.parameters()`` order."""
        self._groups, self._order, self._comm, self._experts = groups, order, comm, experts
        self.scaler, self._clock = scaler, clock
        self.last_norm: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None
        self.left_out: set[tuple[int, int]] = set()  # (group, parameter) another runtime's norm counts instead
        self.across: Collectives | None = None  # ranks holding the model's other parts (a tensor-parallel group)

    def leave_out(self, g: "BlockGroup", i: int) -> None:
        """Parameter ``i`` of ``g`` out of this runtime's norm: a tied weight's copy, which the norm over the
        pipeline's stages counts once, in the stage holding the weight itself (``parallel.tied_stages``)."""
        self.left_out.add((g.index, i))
        self._order = [(h, j) for h, j in self._order if (h.index, j) not in self.left_out]

    def sum_over(self, group: Collectives) -> None:
        """The norm is the norm over ``group``'s ranks' gradients together (tensor parallel: each rank holds
        its shard of every block; a whole parameter is counted on one rank, the others leave it out)."""
        self.across = group

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the true (unscaled) gradients, and the clip coefficient that follows from it."""
        self.last_norm = self._total(norm_type)
        if self.scaler is not None:
            self.last_norm = self.last_norm / self.scaler.scale
        self.clip_coef = clip_coefficient(max_norm, self.last_norm)
        return self.last_norm

    def take(self, norm: torch.Tensor, max_norm: float) -> None:
        """A norm found over more gradients than this runtime's (every stage of a pipeline, each stage's
        runtime holding its own: ``api.stages_optimizer``), and the clip coefficient that follows from it."""
        self.last_norm, self.clip_coef = norm, clip_coefficient(max_norm, norm)

    def usable(self) -> bool:
        return bool(torch.isfinite(self.last_norm))

    def coefficient(self) -> torch.Tensor | None:
        """What every gradient is multiplied by in the update: the clip coefficient, times 1/scale in
        fp16 (a power of two, so the product rounds exactly as unscaling then clipping would). An fp16
        step whose gradients are not all finite is skipped, as GradScaler skips it, and its scale backs off."""
        if self.scaler is None:
            return self.clip_coef
        if self.clip_coef is None:
            self.last_norm = self._total() / self.scaler.scale
        self._clock.skip_step = not self.usable()
        inv = torch.tensor(1.0 / self.scaler.scale)
        self.scaler.update(self._clock.skip_step)
        if self._clock.skip_step:
            for g in self._groups:  # the overflowed gradients are dropped, not carried into the next step
                g.release()
            return None
        return inv if self.clip_coef is None else self.clip_coef * inv

    def end_step(self) -> None:
        self.clip_coef = None

    def _total(self, norm_type: float = 2.0) -> torch.Tensor:
        own = self._own_total(norm_type)
        if self.across is None or self.across.world_size == 1:
            return own
        return sharded_norm([(self.across, [own])], [], norm_type)

    def _own_total(self, norm_type: float) -> torch.Tensor:
        expert = {id(g.experts) for g in self._groups if g.experts is not None}
        order = self._order
        mine = [(g, i) for g, i in order if g.shard is not None]
        if self._comm.world_size == 1 or not mine and self._experts is None:  # every rank holds every gradient:
            return total_norm(_grad_views(order), norm_type)                  # torch's own norm, as DDP clips
        held = [(g, i) for g, i in order if id(g) in expert]
        whole = [(g, i) for g, i in order if g.shard is None and id(g) not in expert]
        parts = [(self._comm, _shard_views(mine))]
        if self._experts is not None:  # experts' gradients: split over the ranks of an expert group
            parts.append((self._experts.a2a, _grad_views(held)))
        return sharded_norm(parts, _grad_views(whole), norm_type)


def _grad_views(order: list[tuple["BlockGroup", int]]) -> list[torch.Tensor]:
    """Views of the gradients in ``order`` that exist, each group's chunk viewed once."""
    seen: dict[int, list[torch.Tensor | None]] = {}
    out = []
    for g, i in order:
        if g.index not in seen:
            seen[g.index] = g.grad_views()
        view = seen[g.index][i]
        if view is not None:
            out.append(view)
    return out


def _shard_views(order: list[tuple["BlockGroup", int]]) -> list[torch.Tensor]:
    """This rank's pieces of the sharded blocks' gradients, of the parameters in ``order``."""
    counted = {(g.index, i) for g, i in order}
    out, done = [], set()
    for g, _ in order:
        if g.index in done:
            continue
        done.add(g.index)
        out += [v for v, i in g.shard_grad_pieces() if (g.index, i) in counted]
    return out
