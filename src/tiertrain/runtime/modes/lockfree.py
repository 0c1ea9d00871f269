"""``lockfree`` (ANGEL-PTM Alg. 2): the device never waits for the optimizer unless a block's params
would be more than ``max_staleness`` steps old. Gradients gather in a block's buffer; an update
loop takes whatever has gathered (with the hyperparameters of the latest step it holds) and keeps
going while more comes. A disk-homed block's loop waits for ``max_staleness`` steps of gradients
per pass, since each pass costs the states' disk traffic whatever it carries."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from tiertrain.errors import ConfigError
from tiertrain.optim import AdamWHyper
from tiertrain.plan import Plan, Tier
from tiertrain.plan.update_modes import steps_per_disk_pass
from tiertrain.runtime.modes.base import ModeContext, UpdatableGroup, UpdateMode


class LockfreeMode(UpdateMode):
    reads_ahead = False  # a block's loop may be moving its states at any moment: one mover per chunk
    takes_grads_any_time = True
    reports_staleness = True

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.max_staleness = ctx.plan.max_staleness
        self._running: set[int] = set()  # blocks whose loop runs (guarded by each block's grad lock)
        self._seen = 0                    # the most steps a block's params lagged since last asked
        self._seen_lock = threading.Lock()

    @classmethod
    def check(cls, plan: Plan) -> None:
        """Lockfree with lag over sharded blocks is refused: whether a rank gathers a block's params
        again depends on whether its own update has published them yet, so ranks could issue different
        collectives and hang. At staleness 0 every block waits for its update, on every rank."""
        super().check(plan)
        if plan.max_staleness > 0 and plan.parallel.dp > 1 and any(b.shard for b in (*plan.blocks, plan.rest)):
            raise ConfigError(f"lockfree updates with max staleness {plan.max_staleness} over {plan.parallel.dp} "
                              "ranks need replicated blocks: use max staleness 0 (--max-staleness 0), a fixed lag of one "
                              "step (fixed_lag=True, or \"fixed_lag\": true in the plan), update "
                              "'overlap', or a replicated layout (a plan file whose blocks say \"shard\": false, as "
                              "`tiertrain plan --nproc N` writes where replicating is faster; in Python "
                              "tiertrain.plan.data_parallel(plan, N, shard=False))")

    def params_ready(self, g: UpdatableGroup) -> None:
        """Return once the block's params are at most ``max_staleness`` steps old (the staleness is recorded)."""
        clock = self.ctx.clock
        while clock.steps_taken - g.version > self.max_staleness:
            self.submit_loop(g)  # the gradients it holds back must be applied now
            pending = g.update_future
            if pending is None:
                break
            pending.result()
            if pending is g.update_future and clock.steps_taken - g.version > self.max_staleness:
                break  # its loop ended without the missing step's gradients (none were produced)
        with self._seen_lock:
            self._seen = max(self._seen, clock.steps_taken - g.version)

    def pop_staleness(self) -> int:
        with self._seen_lock:
            seen, self._seen = self._seen, 0
        return seen

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        raise ConfigError("lockfree updates start before a global norm exists, so they cannot clip by it; "
                          "train without clipping (grad_clip: 0) or use --update overlap")

    def step_hypers(self) -> list[AdamWHyper] | None:
        return self.ctx.hypers()

    def grads_final(self, g: UpdatableGroup) -> None:
        steps = steps_per_disk_pass("lockfree", self.max_staleness)
        self.submit_loop(g, coalesce=steps if g.plan.home is Tier.DISK else 1)

    def step(self, later: Mapping[int, Callable[[], None]] | None = None) -> None:
        """Updates are already running; the device does not wait (no reduction is left for the step: the
        loops take gradients as they land)."""
        self.ctx.clock.steps_taken += 1
        self.ctx.clock.micro = 0

    def wait_all(self) -> None:
        for g in self.ctx.groups:
            self.submit_loop(g)  # what the loops held back to coalesce
        super().wait_all()

    def zero_grad(self, g: UpdatableGroup) -> None:
        """Flushed gradients belong to the block's loop now."""

    def submit_loop(self, g: UpdatableGroup, coalesce: int = 1) -> None:
        """Keep updating the block while its gathered gradients span ``coalesce`` steps or more; start
        a loop only if none runs. (``params_ready`` forces a pass with ``coalesce=1`` when a block
        would otherwise be staler than allowed, and so does ``wait_all``.)"""
        with g.grad_lock:
            if g.index in self._running or not g.grads_span(coalesce):
                return
            self._running.add(g.index)

        def loop() -> None:
            while True:
                g.update(self.ctx.hypers(), None)
                with g.grad_lock:
                    if not g.grads_span(coalesce):
                        self._running.discard(g.index)
                        return

        g.run_update(self.pool, loop)
