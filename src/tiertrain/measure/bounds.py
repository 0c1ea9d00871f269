"""How much a measurement may take: profiling never needs what the planned run needs.

Before a model or one of its blocks is run to be profiled, what the run would hold (weights,
gradients, saved activations at the batch shape) and how long it would take (its forward at this
machine's probed rates, times the passes ``measure_profile`` makes) are estimated. It runs only within
``MeasureBounds``: half the memory this machine has free now, and a few seconds. Otherwise a reduced
shape is measured and scaled by FLOPs and bytes (``shapes`` says which, in order), or, where even the
smallest does not fit, the plan comes from the FLOP estimate alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from tiertrain.memory.capacity import host_available
from tiertrain.units import format_bytes

MEMORY_SHARE = 0.5      # of the memory free now (host, and the device's on a GPU)
SECONDS = 5.0           # "a few seconds"
MIN_TOKENS = 32         # a row shorter than this no longer behaves like the run's (matmuls turn memory-bound)
FIRST_TOUCH_BPS = 1e9   # allocating and first writing memory (page faults), weights and gradients alike:
                        # 1.1-4.8 GB/s on our 2-core VM (a GPT3-81B block's 5 GB of fp32 weights took 4.4 s)
STEP_FORWARDS = (6, 7)  # measure_profile: warm-up and counting passes (3 forwards' time each), then per timed
                        # step a plain forward+backward (3) and a checkpointed one (4)


@dataclass(frozen=True)
class MeasureBounds:
    """What one measurement may hold and take."""

    memory: int
    seconds: float

    @classmethod
    def default(cls, device: torch.device) -> "MeasureBounds":
        free = host_available()
        if device.type == "cuda":
            free = min(free, torch.cuda.mem_get_info(device)[0])
        return cls(int(MEMORY_SHARE * free), SECONDS)

    def describe(self) -> str:
        return f"{format_bytes(self.memory)} and {self.seconds:g} s"


UNBOUNDED = MeasureBounds(1 << 62, float("inf"))


@dataclass(frozen=True)
class RunCost:
    memory: int
    seconds: float

    def within(self, bounds: MeasureBounds) -> bool:
        return self.memory <= bounds.memory and self.seconds <= bounds.seconds


def run_cost(params: int, precision: str, act_bytes: int, hidden_bytes: int, forward_s: float, steps: int,
             fresh_weights: bool) -> RunCost:
    """What ``measure_profile`` of ``steps`` timed steps holds and takes: fp32 weights and gradients
    (and autocast's 16-bit copies), the saved activations and as much again in flight in backward,
    the input and its gradient; its passes' forwards, and first touching what it allocates (the
    weights too where a real copy is drawn: ``fresh_weights``)."""
    weights = params * (8 + (2 if precision != "fp32" else 0))
    memory = weights + 2 * act_bytes + 3 * hidden_bytes
    touched = memory - (0 if fresh_weights else 4 * params)
    seconds = (STEP_FORWARDS[0] + STEP_FORWARDS[1] * steps) * forward_s + touched / FIRST_TOUCH_BPS
    return RunCost(memory, seconds)


def shapes(batch: int, seq: int) -> Iterator[tuple[int, int]]:
    """The run's shape, then fewer rows (halving the batch to one: everything a block does scales
    with rows exactly), then fewer tokens per row (halving the sequence, down to ``MIN_TOKENS``)."""
    yield batch, seq
    b = batch
    while b > 1:
        b = max(1, b // 2)
        yield b, seq
    s = seq
    while s // 2 >= MIN_TOKENS:
        s //= 2
        yield 1, s


def pick_shape(cost: Callable[[int, int, int], RunCost], batch: int, seq: int,
               bounds: MeasureBounds) -> tuple[int, int, int] | None:
    """(rows, tokens per row, timed steps) of the first shape whose measurement fits ``bounds``
    (three timed steps where they fit, else one), or None where none does."""
    for b, s in shapes(batch, seq):
        for steps in (3, 1):
            if cost(b, s, steps).within(bounds):
                return b, s, steps
    return None
