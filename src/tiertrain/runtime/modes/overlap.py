"""``overlap`` (STRONGHOLD's concurrent CPU optimizers): block updates run on worker threads while
the device goes on. Without clipping or accumulation a block is updated as soon as its
gradients are in, during backward; when the step needs the global norm (clipping) or the fp16
overflow check first, every block is updated once backward ends, in forward order (the
embeddings first), so the updates run just ahead of the next forward. Same numerics as sync."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiertrain.errors import ConfigError
from tiertrain.runtime.modes.base import UpdateMode

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup


class OverlapMode(UpdateMode):
    def grads_final(self, g: "BlockGroup") -> None:
        rt = self.rt
        if not rt.waits_for_norm and rt.final_micro():
            self.submit(g, None)
            rt.updates_started = True

    def backward_done(self, final: bool) -> None:
        rt = self.rt
        if not (final and rt.waits_for_norm):
            return
        if rt.options.max_grad_norm is not None:
            rt.clip_grad_norm_(rt.options.max_grad_norm)
            if rt.scaler is None and not rt.norm_is_usable():
                rt.nonfinite_norm = True  # updating would write NaN into every master: none starts
                rt.updates_started = True
                return
        coef = rt.grad_coefficient()
        if not rt.skip_step:
            for g in rt.update_order():
                self.submit(g, coef)
        rt.updates_started = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Updates start as backward ends, clipped by the norm declared at setup: the loop's call only
        reads that norm back, and must ask for the same clipping."""
        if self.rt.options.max_grad_norm is None:
            raise ConfigError("in overlap mode without declared clipping each block's gradients are updated away "
                              "during backward, so no norm of them is kept: declare it up front, "
                              f"tiertrain.setup(..., max_grad_norm={max_norm}), or use update='sync'")
        if self.rt.options.max_grad_norm != max_norm:
            raise ConfigError(f"in overlap mode updates start during backward, so clipping must be declared up front: "
                              f"tiertrain.setup(..., max_grad_norm={max_norm})")
        return self.rt.last_norm

    def after_step(self) -> None:
        """The step returns at once: the updates' futures are waited for at each block's next use."""
