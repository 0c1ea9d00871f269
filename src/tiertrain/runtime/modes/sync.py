"""``sync``: every block is updated when the step is taken, in the step's thread, and the step returns when
all are done; but a block whose gradients' reduction over the ranks the step left in flight (gradients
reduced once a step: ``BackwardPass.hand_over``) is landed and updated at its next use. Numerically plain
PyTorch's; the simplest to reason about."""

from __future__ import annotations

from tiertrain.runtime.modes.base import UpdateMode


class SyncMode(UpdateMode):
    pass
