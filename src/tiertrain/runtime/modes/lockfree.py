"""``lockfree`` (ANGEL-PTM Alg. 2): the device never waits for the optimizer unless a block's params
would be more than ``max_staleness`` steps old. Gradients gather in a block's buffer; an update
loop takes whatever has gathered (with the hyperparameters of the latest step it holds) and keeps
going while more comes. A disk-homed block's loop waits for ``max_staleness`` steps of gradients
per pass, since each pass costs the states' disk traffic whatever it carries."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from tiertrain.errors import ConfigError
from tiertrain.optim import AdamWHyper
from tiertrain.plan import Tier
from tiertrain.plan.bytes import steps_per_disk_pass
from tiertrain.runtime.modes.base import UpdateMode

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup
    from tiertrain.runtime.runtime import Runtime


class LockfreeMode(UpdateMode):
    reads_ahead = False  # a block's loop may be moving its states at any moment: one mover per chunk

    def __init__(self, rt: "Runtime", workers: int) -> None:
        super().__init__(rt, workers)
        self.max_staleness = rt.plan.max_staleness
        self._running: set[int] = set()  # blocks whose loop runs (guarded by each block's grads.lock)
        self._seen = 0                    # the most steps a block's params lagged since last asked
        self._seen_lock = threading.Lock()

    def params_ready(self, g: "BlockGroup") -> None:
        """Return once the block's params are at most ``max_staleness`` steps old (the staleness is recorded)."""
        rt = self.rt
        while rt.steps_taken - g.version > self.max_staleness:
            self.submit_loop(g)  # the gradients it holds back must be applied now
            pending = g.pending
            if pending is None:
                break
            pending.result()
            if pending is g.pending and rt.steps_taken - g.version > self.max_staleness:
                break  # its loop ended without the missing step's gradients (none were produced)
        with self._seen_lock:
            self._seen = max(self._seen, rt.steps_taken - g.version)

    def pop_staleness(self) -> int:
        with self._seen_lock:
            seen, self._seen = self._seen, 0
        return seen

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        raise ConfigError("lockfree updates start before a global norm exists, so they cannot clip by it; "
                          "train without clipping (grad_clip: 0) or use --update overlap")

    def step_hypers(self) -> list[AdamWHyper] | None:
        return self.rt.hypers()

    def grads_final(self, g: "BlockGroup") -> None:
        steps = steps_per_disk_pass("lockfree", self.max_staleness)
        self.submit_loop(g, coalesce=steps if g.plan.home is Tier.DISK else 1)

    def step(self) -> None:
        """Updates are already running; the device does not wait."""
        self.rt.steps_taken += 1
        self.rt.micro = 0

    def wait_all(self) -> None:
        for g in self.rt.groups:
            self.submit_loop(g)  # what the loops held back to coalesce
        super().wait_all()

    def zero_grad(self, g: "BlockGroup") -> None:
        """Flushed gradients belong to the block's loop now."""

    def submit_loop(self, g: "BlockGroup", coalesce: int = 1) -> None:
        """Keep updating the block while its gathered gradients span ``coalesce`` steps or more; start
        a loop only if none runs. (``params_ready`` forces a pass with ``coalesce=1`` when a block
        would otherwise be staler than allowed, and so does ``wait_all``.)"""
        with g.grads.lock:
            if g.index in self._running or not self._due(g, coalesce):
                return
            self._running.add(g.index)

        def loop() -> None:
            while True:
                self.update_now(g, None, self.rt.hypers())
                with g.grads.lock:
                    if not self._due(g, coalesce):
                        self._running.discard(g.index)
                        return

        g.pending = self.pool.submit(loop)

    @staticmethod
    def _due(g: "BlockGroup", coalesce: int) -> bool:
        """Whether the block's gathered gradients span ``coalesce`` steps (call under ``grads.lock``)."""
        return g.grads.chunk is not None and g.grads.step + 1 - g.version >= coalesce
