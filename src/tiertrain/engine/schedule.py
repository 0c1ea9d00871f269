"""Linear warm-up then cosine decay, as a pure function of the step (so resume needs only the step)."""

from __future__ import annotations

import math


def lr_at(step: int, peak: float, floor: float, warmup: int, total: int) -> float:
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
