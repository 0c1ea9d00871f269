"""Where a run is in its optimizer steps: the one record every block group, the backward pass and
the update mode read (and the step advances), instead of each keeping its own count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepClock:
    grad_accum: int = 1           # micro-batches per optimizer step
    steps_taken: int = 0          # optimizer steps the user has taken
    micro: int = 0                # backward passes in the current accumulation window
    updates_started: bool = False  # this step's updates have begun: no backward may run before the step
    skip_step: bool = False       # fp16: this step's gradients overflowed; no block is updated
    nonfinite_norm: bool = False  # overlap with clipping: the norm was NaN/inf, so no update was started
    sync_wait_s: float = 0.0      # seconds the step's thread waited for reductions to land (the exposed DP.sync)

    def final_micro(self) -> bool:
        """Whether the backward running (or next) is the last micro-batch of the step."""
        return self.micro + 1 >= self.grad_accum

    def end_step(self) -> None:
        self.updates_started, self.skip_step, self.micro = False, False, 0
