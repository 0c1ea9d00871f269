"""What the three update modes share, and the one interface the runtime calls them through.

A mode decides when a block's update runs (after backward, during it, or on a loop the device
never waits for), when the device may use a block's params again, and what a step and
``zero_grad`` do. It is chosen once, from the plan (``make_mode``); nothing outside the modes
tests the plan's update mode: what differs between them is asked of the mode.

A mode sees the run through ``ModeContext`` and the groups through ``UpdatableGroup``: it runs
and waits for their updates and drops their gradients; it never reaches into a group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch

from tiertrain.optim import AdamWHyper
from tiertrain.errors import ConfigError
from tiertrain.plan import BlockPlan, Plan
from tiertrain.plan.update_modes import rules
from tiertrain.runtime.step_clock import StepClock
from tiertrain.runtime.step_norm import StepNorm

if TYPE_CHECKING:
    from tiertrain.runtime.state_moves import StateMoves


class UpdatableGroup(Protocol):
    """What a mode may ask of a block group."""

    index: int
    plan: BlockPlan
    version: int            # its params include the updates of steps below this
    update_future: Future | None
    grad_lock: ContextManager[Any]

    def update(self, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None: ...
    def publish_and_take(self) -> Any: ...
    def update_taken(self, taken: Any, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None: ...
    def update_lagged(self, hypers: list[AdamWHyper], coef: torch.Tensor | None,
                      published: Callable[[], None]) -> None: ...
    def update_now(self, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None: ...
    def land_and_update(self, landing: Callable[[], None], hypers: list[AdamWHyper],
                        coef: torch.Tensor | None) -> None: ...
    def run_update(self, pool: Executor, fn: Callable[..., None], *args: Any) -> Future: ...
    def update_idle(self) -> bool: ...
    def wait_update(self) -> None: ...
    def finish_update(self) -> None: ...
    def release(self) -> None: ...
    def grads_span(self, steps: int) -> bool: ...


@dataclass(frozen=True)
class ModeContext:
    """The run, as an update mode sees it."""

    groups: list[UpdatableGroup]             # in block order, the rest last
    clock: StepClock
    norm: StepNorm
    moves: "StateMoves"
    hypers: Callable[[], list[AdamWHyper]]   # the optimizer's hyperparameters as they are now (a snapshot)
    settle: Callable[[], None]               # a step begins: copies into device slots landed, read-ahead restarted
    max_grad_norm: float | None              # clipping declared at setup
    waits_for_norm: bool                     # the step needs the global norm (clipping, fp16) before any update
    plan: Plan


class UpdateMode:
    """Sync's behaviour, which the others refine: updates run when the step is taken."""

    reads_ahead = True              # disk states may be read in during forward and backward, ahead of updates
    updates_in_backward_order = False  # each block is updated as backward finishes it, so forward's read-ahead
    #                                    may use the update workers' places (``runtime.read_ahead``)
    takes_grads_any_time = False    # an update loop may take a block's grad chunk at any moment
    reports_staleness = False       # the run reports how stale the params a forward used were

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self.pool = ThreadPoolExecutor(ctx.plan.update_workers, thread_name_prefix="tiertrain-optim")
        self._later: dict[int, Callable[[], None]] = {}  # block index -> its step's landing and update, due at its next use

    @classmethod
    def check(cls, plan: Plan) -> None:
        """Refuse a plan this mode cannot run, before anything is allocated: blocks over several device
        streams (``runtime.streams``) only where every update runs after backward has joined the streams in
        the step's thread (sync); a worker's update during backward would not wait for the chunks' streams."""
        if not rules(plan.update).updates_as_final or not any(b.streams > 1 for b in plan.blocks):
            return
        raise ConfigError(f"blocks over several streams (\"streams\" > 1) run with update 'sync', not {plan.update!r}: "
                          "an update on a worker thread would not wait for the chunks' device streams; use --update "
                          "sync, or \"streams\": 1 in the plan")

    # -- the device side -------------------------------------------------------------------
    def params_ready(self, g: UpdatableGroup) -> None:
        """Return when the block's params may be used: once its update is written back (a step's update left
        for this use, ``land_later``, run first)."""
        self._run_due(g)
        self.ctx.moves.settle(g)

    def _run_due(self, g: UpdatableGroup) -> None:
        """The landing and update the step left for ``g``'s next use, if any, now."""
        due = self._later.pop(g.index, None)
        if due is not None:
            due()

    def update_due(self, g: UpdatableGroup) -> bool:
        """Whether the step left ``g``'s update for its next use, in this thread (``land_later``)."""
        return g.index in self._later

    def step_hypers(self) -> list[AdamWHyper] | None:
        """Hyperparameters to keep with this step's gradients (None: the update's own, taken then)."""
        return None

    def grads_final(self, g: UpdatableGroup) -> None:
        """A block's gradients of this backward are all in its chunk."""

    def backward_done(self, final: bool) -> None:
        """A backward pass ended; ``final``: the last micro-batch of the step."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The loop's ``clip_grad_norm_``: the global norm, and the coefficient the updates will apply."""
        return self.ctx.norm.clip_grad_norm_(max_norm, norm_type)

    def pop_staleness(self) -> int:
        """The most steps a block's params lagged since last asked (0 where they never lag)."""
        return 0

    # -- the step --------------------------------------------------------------------------
    def step(self, later: Mapping[int, Callable[[], None]] | None = None) -> None:
        """``later``: reductions still in flight, by block index (``BackwardPass.hand_over``): those blocks are
        landed and updated by ``land_later``, the others as the mode does."""
        ctx, clock = self.ctx, self.ctx.clock
        later = later or {}
        clock.steps_taken += 1
        ctx.settle()
        if later and not clock.skip_step:
            coef = ctx.norm.coefficient()
            for g in self.update_order():
                if g.index in later:
                    self.land_later(g, later[g.index], coef)
        if not clock.updates_started:
            if ctx.max_grad_norm is not None and ctx.norm.clip_coef is None:  # declared, and the loop did not clip
                ctx.norm.clip_grad_norm_(ctx.max_grad_norm)
            coef = ctx.norm.coefficient()
            for g in self.update_order():
                if not clock.skip_step and g.index not in later:
                    g.update_now(ctx.hypers(), coef)
        self.after_step()
        clock.end_step()
        ctx.norm.end_step()

    def land_later(self, g: UpdatableGroup, landing: Callable[[], None], coef: torch.Tensor | None) -> None:
        """``g``'s reduction lands, and ``g`` is updated, in the step's thread at its next use (FOLD3D's
        ``seg.flush()`` before a segment's forward), with this step's hyperparameters (a scheduler may set
        the next step's before then). One still due from a step the block was not used after runs first."""
        self._run_due(g)
        hypers = self.ctx.hypers()
        self._later[g.index] = lambda: self._timed_landing(g, landing, hypers, coef)

    def _timed_landing(self, g: UpdatableGroup, landing: Callable[[], None], hypers: list[AdamWHyper],
                       coef: torch.Tensor | None) -> None:
        def timed() -> None:  # the wait for the network, not the update, is the exposed DP.sync
            began = time.perf_counter()
            landing()
            self.ctx.clock.sync_wait_s += time.perf_counter() - began
        g.land_and_update(timed, hypers, coef)

    def update_order(self) -> list[UpdatableGroup]:
        """The rest (embeddings) first: the next forward starts there."""
        return self.ctx.groups[-1:] + self.ctx.groups[:-1]

    def after_step(self) -> None:
        """The step's updates done, but for those left for their blocks' next use (``land_later``)."""
        self._finish_updates()

    def wait_all(self) -> None:
        """Every gradient taken into the states and every state home (checkpoints, the end)."""
        for g in self.update_order():
            self._run_due(g)
        self._finish_updates()

    def _finish_updates(self) -> None:
        for g in self.ctx.groups:
            g.finish_update()
        self.ctx.moves.drain()

    def zero_grad(self, g: UpdatableGroup) -> None:
        if g.update_future is None and g.index not in self._later:  # an update in flight or due takes (and
            g.release()                                              # frees) the gradients itself

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- running updates -------------------------------------------------------------------
    def submit(self, g: UpdatableGroup, coef: torch.Tensor | None) -> Future:
        """Update one block on a worker; its next use waits on the returned future. The hyperparameters
        are copied now: by the time the worker runs, the loop may have set the next step's learning rate."""
        return g.run_update(self.pool, g.update, self.ctx.hypers(), coef)
