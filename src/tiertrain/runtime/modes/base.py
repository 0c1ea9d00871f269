"""What the three update modes share, and the one interface the runtime calls them through.

A mode decides when a block's update runs (after backward, during it, or on a loop the device
never waits for), when the device may use a block's params again, and what a step and
``zero_grad`` do. It is chosen once, from the plan (``make_mode``); the runtime never tests the
plan's update mode itself.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tiertrain.optim import AdamWHyper
from tiertrain.plan.bytes import in_pieces
from tiertrain.runtime.pieces import update_in_pieces

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup
    from tiertrain.runtime.runtime import Runtime


class UpdateMode:
    """Sync's behaviour, which the others refine: updates run when the step is taken."""

    reads_ahead = True     # disk states may be read in during forward and backward, ahead of updates

    def __init__(self, rt: "Runtime", workers: int) -> None:
        self.rt = rt
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tiertrain-optim")

    # -- the device side -------------------------------------------------------------------
    def params_ready(self, g: "BlockGroup") -> None:
        """Return when the block's params may be used: once its update is written back."""
        self.rt.moves.settle(g)

    def step_hypers(self) -> list[AdamWHyper] | None:
        """Hyperparameters to keep with this step's gradients (None: the update's own, taken then)."""
        return None

    def grads_final(self, g: "BlockGroup") -> None:
        """A block's gradients of this backward are all in its chunk."""

    def backward_done(self, final: bool) -> None:
        """A backward pass ended; ``final``: the last micro-batch of the step."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The loop's ``clip_grad_norm_``: the global norm, and the coefficient the updates will apply."""
        return self.rt.clip_grad_norm_(max_norm, norm_type)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> None:
        rt = self.rt
        rt.steps_taken += 1
        rt.cache.settle()
        rt.restart_reads()
        if not rt.updates_started:
            if rt.options.max_grad_norm is not None and rt.clip_coef is None:  # declared, and the loop did not clip
                rt.clip_grad_norm_(rt.options.max_grad_norm)
            coef = rt.grad_coefficient()
            for g in rt.update_order():
                if not rt.skip_step:
                    self.update_now(g, coef, None)
        self.after_step()
        rt.end_step()

    def after_step(self) -> None:
        self.wait_all()

    def wait_all(self) -> None:
        """Every gradient taken into the states and every state home (checkpoints, the end)."""
        for g in self.rt.groups:
            if g.pending is not None:
                g.pending.result()
                g.pending = None
        self.rt.moves.drain()

    def zero_grad(self, g: "BlockGroup") -> None:
        if g.pending is None:  # an update in flight takes (and frees) the gradients itself
            g.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- running updates -------------------------------------------------------------------
    def update_now(self, g: "BlockGroup", coef: torch.Tensor | None, hypers: list[AdamWHyper] | None) -> None:
        """Update one block in this thread: its states in, AdamW, its params published, states home
        (a block updated in pieces does all of it a piece at a time)."""
        if in_pieces(g.plan):
            update_in_pieces(g, hypers or self.rt.hypers(), coef)
            return
        moves = self.rt.moves
        moves.bring_in(g)
        g.update(hypers or self.rt.hypers(), coef)
        moves.send_home(g)

    def submit(self, g: "BlockGroup", coef: torch.Tensor | None) -> Future:
        """Update one block on a worker; its next use waits on the returned future. The hyperparameters
        are copied now: by the time the worker runs, the loop may have set the next step's learning rate."""
        g.pending = self.pool.submit(self.update_now, g, coef, self.rt.hypers())
        return g.pending
