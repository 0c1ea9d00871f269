"""``lockfree`` at a fixed lag of one step (``Plan.fixed_lag``; ZeRO-Offload's delayed parameter update):
step s computes with the params that include the updates of steps before s - 1, exactly, on every rank.

A free update loop (``lockfree``) takes whatever gradients have gathered and publishes whenever it is
done, so when a block's params change depends on each rank's timing: the ranks of a tensor-parallel group
would read one block at different ages and the parameters each holds whole (norms, biases) would part,
and sharded blocks' ranks would gather at different steps. Here a block's update of step v is two halves,
started once its gradients of step v are in and the update of step v - 1 has ended:

- the publish, on a thread of its own (a copy, never queued behind other blocks' AdamW): the master's
  params (step v - 1's update) into the compute copy, and the step's gradients taken. The block's next
  forward waits for this alone.
- AdamW into the master alone, on the update workers, while the device goes on.

The device waits for an AdamW only where the block's update of the step before has not ended by the time
its next gradients are in: about a step for each update. A master homed on disk is read in by its update,
so there both halves run on the worker, one after the other, and the block's next forward waits until the
workers reach it: they take the updates in backward's order, the embeddings' last, so the next forward's
first blocks wait behind the others' disk traffic (reading the master alone ahead of its update, on the
publisher, would lift that: not done yet).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from tiertrain.optim import AdamWHyper
from tiertrain.plan import Plan, Tier
from tiertrain.plan.bytes import master_home
from tiertrain.runtime.modes.base import ModeContext, UpdatableGroup, UpdateMode
from tiertrain.runtime.modes.lockfree import LockfreeMode


class FixedLagMode(LockfreeMode):
    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._published: dict[int, Future] = {}  # block index -> its update's publish (and gradients taken)
        self._ahead: set[int] = set()  # blocks whose master an update moved past their params
        self._final: set[int] = set()  # blocks whose gradients of this step are in
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="tiertrain-publish")

    @classmethod
    def check(cls, plan: Plan) -> None:
        """Sharded blocks too (a free loop's lag is refused over them): every rank's update of a step
        publishes before the block's next use waits for it, so every rank gathers the block anew there."""
        UpdateMode.check(plan)

    def params_ready(self, g: UpdatableGroup) -> None:
        """Once the block's update has published the step before's params (its error, if it failed, here)."""
        published = self._published.get(g.index)
        if published is not None:
            published.result()
        with self._seen_lock:
            self._seen = max(self._seen, self.ctx.clock.steps_taken - g.version)

    def update_due(self, g: UpdatableGroup) -> bool:
        """An update of the block's may not have published yet: a gather ahead waits for it
        (``params_ready``) before it reads the slot's state, so that every rank starts the same gathers."""
        return g.index in self._published

    def grads_final(self, g: UpdatableGroup) -> None:
        """The step's gradients are in: the block's update of the step before ends (its AdamW is what this
        one publishes), and this step's starts."""
        self._start(g)
        self._ahead.add(g.index)
        self._final.add(g.index)

    def step(self, later: Mapping[int, Callable[[], None]] | None = None) -> None:
        """A block whose master is ahead of its params but that got no gradient this step (an expert no token
        reached, a block the forward skipped) still publishes, as every block does once a step: its lag stays
        one step. At the step, on every rank alike."""
        for g in self.ctx.groups:
            if g.index in self._ahead and g.index not in self._final:
                self._start(g)  # it takes no gradients: a publish alone
                self._ahead.discard(g.index)
        self._final.clear()
        super().step(later)

    def _start(self, g: UpdatableGroup) -> None:
        g.finish_update()
        hypers = self.ctx.hypers()
        if master_home(g.plan) is Tier.DISK:
            published: Future = Future()
            self._published[g.index] = published
            g.run_update(self.pool, _both_halves, g, hypers, published)
            return
        published = self._publisher.submit(g.publish_and_take)
        self._published[g.index] = published
        g.run_update(self.pool, _adamw_half, g, published, hypers)

    def wait_all(self) -> None:
        """Every update ended. The params stay a step behind the master: a checkpoint or a state dict reads
        the master, and the training goes on as it would have without them."""
        self._finish_updates()

    def close(self) -> None:
        self._publisher.shutdown(wait=True)
        super().close()


def _adamw_half(g: UpdatableGroup, published: Future, hypers: list[AdamWHyper]) -> None:
    g.update_taken(published.result(), hypers, None)


def _both_halves(g: UpdatableGroup, hypers: list[AdamWHyper], published: Future) -> None:
    """A disk-homed master's update: ``published`` resolved once its params are, or with the error that
    stopped it first (the block's next forward raises it)."""
    try:
        g.update_lagged(hypers, None, lambda: published.set_result(None))
    except BaseException as exc:
        if not published.done():
            published.set_exception(exc)
        raise
