"""What the overlap update mode counts as exposed DP.sync (``StepClock.sync_wait_s``, what ``bench pipeline``
prints): the part of a block's wait at its next use before its handed-over reduction landed, not the update
that follows it on the worker (sync would spend that too). A stand-in clock and block: no timing."""

from types import SimpleNamespace

import pytest

from tiertrain.runtime.modes import overlap
from tiertrain.runtime.step_clock import StepClock


class _Block:
    """A block whose worker runs when its next use waits (``wait_update``), or before (``run_worker``): the
    landing takes ``landing_s`` of the stand-in clock, the update ``update_s``."""

    index = 0

    def __init__(self, clock: SimpleNamespace, landing_s: float, update_s: float) -> None:
        self.clock, self.landing_s, self.update_s, self.work = clock, landing_s, update_s, None

    def run_update(self, pool, fn, *args) -> None:
        self.work = (fn, args)

    def land_and_update(self, landing, hypers, coef) -> None:
        landing()
        self.clock.t += self.update_s

    def run_worker(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work[0](*work[1])

    wait_update = run_worker


@pytest.mark.parametrize("landed_before_the_wait, exposed", [(False, 5.0), (True, 0.0)])
def test_a_blocks_wait_counts_the_reduction_still_landing_not_its_update(monkeypatch, landed_before_the_wait,
                                                                          exposed):
    now = SimpleNamespace(t=0.0)
    monkeypatch.setattr(overlap, "time", SimpleNamespace(perf_counter=lambda: now.t))
    clock = StepClock()
    ctx = SimpleNamespace(plan=SimpleNamespace(update_workers=1), waits_for_norm=False, clock=clock,
                          hypers=list, moves=SimpleNamespace(settle=lambda g: None))
    mode = overlap.OverlapMode(ctx)
    try:
        block = _Block(now, landing_s=5.0, update_s=3.0)

        def landing() -> None:
            now.t += block.landing_s
        mode.land_later(block, landing, None)
        if landed_before_the_wait:  # the worker landed it (and updated) under the forward before this use
            block.run_worker()
            now.t += 2.0
        mode.params_ready(block)
        assert clock.sync_wait_s == exposed  # the 3 s of update the wait also spans are not DP.sync
    finally:
        mode.pool.shutdown()
