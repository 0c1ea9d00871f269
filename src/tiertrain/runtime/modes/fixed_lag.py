"""``lockfree`` at a fixed lag of one step (``Plan.fixed_lag``; ZeRO-Offload's delayed parameter update):
step s computes with the params that include the updates of steps before s - 1, exactly, on every rank.

A free update loop (``lockfree``) takes whatever gradients have gathered and publishes whenever it is
done, so when a block's params change depends on each rank's timing: the ranks of a tensor-parallel group
would read one block at different ages and the parameters each holds whole (norms, biases) would part.
Here a block's update is one job per step, started on a worker once its gradients of step v are in. It
first publishes what the master holds (the update of step v - 1), then takes the step's gradients and
lets the block's next forward go on, then runs AdamW into the master alone. The next step's job publishes
that. The device waits only where the job of step v - 1 has not ended by the time the block's gradients
of step v are in: a whole step for each update to run, as the free loop at max staleness 1 gives.
"""

from __future__ import annotations

import threading

from tiertrain.runtime.modes.base import ModeContext, UpdatableGroup
from tiertrain.runtime.modes.lockfree import LockfreeMode


class FixedLagMode(LockfreeMode):
    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._ready: dict[int, threading.Event] = {}  # block index -> its job published and took its gradients

    def params_ready(self, g: UpdatableGroup) -> None:
        """Once the block's job has published the step before's params (a job that failed first raises here)."""
        ready = self._ready.get(g.index)
        if ready is not None:
            ready.wait()
            pending = g.update_future
            if pending is not None and pending.done():
                pending.result()
        with self._seen_lock:
            self._seen = max(self._seen, self.ctx.clock.steps_taken - g.version)

    def grads_final(self, g: UpdatableGroup) -> None:
        """The step's gradients are in: the job of the step before ends (its AdamW is what this one
        publishes), and this step's starts."""
        g.finish_update()
        ready = threading.Event()
        self._ready[g.index] = ready

        def job() -> None:
            try:
                g.update(self.ctx.hypers(), None, ready.set)
            finally:
                ready.set()  # a job that raised lets the forward reach its error (``params_ready``)
        g.run_update(self.pool, job)

    def wait_all(self) -> None:
        """Every job ended, then the params catch up with the master (a checkpoint, a replan, the end): a
        job without gradients publishes it. Every rank does so at the same step, so a group stays alike."""
        self._finish_updates()
        for g in self.update_order():
            g.run_update(self.pool, g.update, self.ctx.hypers(), None, _nothing)
        self._finish_updates()
        self._ready.clear()


def _nothing() -> None:
    """A catch-up job's ``lagged``: no forward waits for it."""
