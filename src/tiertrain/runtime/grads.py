"""A block's gradients between backward and its update: one chunk, filled as backward finishes the
block (accumulating over micro-batches) and taken whole by the update.

Backward fills and the optimizer takes, possibly on another thread (overlap, lockfree): both go
through the buffer's lock. Taking leaves an empty buffer, so backward starts a fresh chunk while
the update applies the taken one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiertrain.memory.chunk import Chunk
from tiertrain.optim import AdamWHyper


@dataclass
class TakenGrads:
    """A block's gathered gradients, as an update takes them."""

    chunk: Chunk
    has_grad: list[bool]                       # per parameter: whether it got a gradient
    step: int                                  # the latest training step they include
    hypers: list[AdamWHyper] | None = None     # lockfree: that step's hyperparameters (None: the update's)


class GradBuffer:
    def __init__(self, n_params: int) -> None:
        self.n = n_params
        self.chunk: Chunk | None = None        # exists from the first flush until the update takes it
        self.has_grad = [False] * n_params
        self.step = -1                         # the latest step whose gradients are in the chunk
        self.hypers: list[AdamWHyper] | None = None
        self.lock = threading.Lock()

    def take(self) -> TakenGrads | None:
        """Hand the gradients to the optimizer; backward starts a fresh chunk."""
        with self.lock:
            taken = None if self.chunk is None else TakenGrads(self.chunk, self.has_grad, self.step, self.hypers)
            self.chunk, self.has_grad = None, [False] * self.n
            return taken

    def add(self, grads: Sequence[tuple[int, torch.Tensor]], views: Sequence[torch.Tensor], step: int,
            hypers: list[AdamWHyper] | None) -> None:
        """Add fresh gradients, (parameter index, gradient), into the chunk (``views``: its per-parameter
        views). Call under ``lock``, with ``chunk`` set."""
        for i, grad in grads:
            if self.has_grad[i]:
                views[i].add_(grad.to(views[i].device))  # a GPU's gradient into a host chunk: copied first
            else:
                views[i].copy_(grad)
                self.has_grad[i] = True
        self.step, self.hypers = step, hypers

    def mark(self, index: int, step: int, hypers: list[AdamWHyper] | None) -> None:
        """Parameter ``index``'s gradient was written into the chunk in place (``runtime.in_place_grads``)."""
        with self.lock:
            self.has_grad[index] = True
            self.step, self.hypers = step, hypers

    def clear(self) -> Chunk | None:
        """Forget the gradients (zero_grad, a skipped step); the chunk, if any, for the caller to free."""
        with self.lock:
            chunk, self.chunk, self.has_grad = self.chunk, None, [False] * self.n
            return chunk
