"""``sync``: every block is updated when the step is taken, and the step returns when all are done.
Numerically plain PyTorch's; the simplest to reason about."""

from __future__ import annotations

from tiertrain.runtime.modes.base import UpdateMode


class SyncMode(UpdateMode):
    pass
