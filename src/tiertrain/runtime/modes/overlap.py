"""``overlap`` (STRONGHOLD's concurrent CPU optimizers): block updates run on worker threads while
the device goes on. Without clipping or accumulation a block is updated as soon as its
gradients are in, during backward; when the step needs the global norm (clipping) or the fp16
overflow check first, every block is updated once backward ends, in forward order (the
embeddings first), so the updates run just ahead of the next forward. Same numerics as sync."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tiertrain.errors import ConfigError
from tiertrain.runtime.modes.base import ModeContext, UpdatableGroup, UpdateMode


class OverlapMode(UpdateMode):
    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.updates_in_backward_order = not ctx.waits_for_norm
        self._landing: set[int] = set()  # blocks whose update waits on a reduction handed over by the step
        self._landed: dict[int, float] = {}  # block index -> when its handed-over reduction landed (a worker's)

    def grads_final(self, g: UpdatableGroup) -> None:
        clock = self.ctx.clock
        if not self.ctx.waits_for_norm and clock.final_micro():
            self.submit(g, None)
            clock.updates_started = True

    def backward_done(self, final: bool) -> None:
        ctx, clock = self.ctx, self.ctx.clock
        if not (final and ctx.waits_for_norm):
            return
        if ctx.max_grad_norm is not None:
            ctx.norm.clip_grad_norm_(ctx.max_grad_norm)
            if ctx.norm.scaler is None and not ctx.norm.usable():
                clock.nonfinite_norm = True  # updating would write NaN into every master: none starts
                clock.updates_started = True
                return
        coef = ctx.norm.coefficient()
        if not clock.skip_step:
            for g in self.update_order():
                self.submit(g, coef)
        clock.updates_started = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Updates start as backward ends, clipped by the norm declared at setup: the loop's call only
        reads that norm back, and must ask for the same clipping."""
        declared = self.ctx.max_grad_norm
        if declared is None:
            raise ConfigError("in overlap mode without declared clipping each block's gradients are updated away "
                              "during backward, so no norm of them is kept: declare it up front, "
                              f"tiertrain.setup(..., max_grad_norm={max_norm}), or use update='sync'")
        if declared != max_norm:
            raise ConfigError(f"in overlap mode updates start during backward, so clipping must be declared up front: "
                              f"tiertrain.setup(..., max_grad_norm={max_norm})")
        return self.ctx.norm.last_norm

    def land_later(self, g: UpdatableGroup, landing: Callable[[], None], coef: torch.Tensor | None) -> None:
        """On a worker at once: ``g``'s reduction lands there (under the device's next forward), then its
        update; its next use waits for both, and the part of that wait before the reduction landed counts
        as exposed DP.sync (the rest is the update's own time, which sync would spend too)."""
        def landing_noted() -> None:
            landing()
            self._landed[g.index] = time.perf_counter()
        g.run_update(self.pool, g.land_and_update, landing_noted, self.ctx.hypers(), coef)
        self._landing.add(g.index)
        self.ctx.clock.updates_started = True

    def params_ready(self, g: UpdatableGroup) -> None:
        if g.index in self._landing:
            self._landing.discard(g.index)
            began = time.perf_counter()
            g.wait_update()
            ended = time.perf_counter()
            landed = self._landed.pop(g.index, ended)
            self.ctx.clock.sync_wait_s += max(0.0, min(landed, ended) - began)
        super().params_ready(g)

    def after_step(self) -> None:
        """The step returns at once: the updates' futures are waited for at each block's next use."""
