"""A block's gradients on their way over the data-parallel ranks.

The reduction of a block's gradients of a micro-batch (from its stage: ``BlockGroup``) is started
when its backward ends and finished (waited for, added to the grad chunk) when the next block's
backward ends (with hybrid sharding the one after: ``plan.bytes.reductions_in_flight``), or when
backward ends: the network carries it while the next block computes instead of the loop waiting for it. The
collectives are the same calls, on the same buffers, in the same order on every rank: the sums are
those a blocking reduction gives, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiertrain.memory.chunk import Chunk
from tiertrain.optim import AdamWHyper
from tiertrain.parallel.collectives import Waitable


@dataclass
class Reduction:
    """A block's gradients of one micro-batch on their way over the ranks: the collectives in flight
    (waited in order), the grad chunk this rank's part lands in, which parameters any rank had a
    gradient for, the step (and lockfree's hyperparameters) they belong to, whether the micro-batch is
    the step's last, and the device-tier chunks the collectives use (freed once they have landed)."""

    works: list[Waitable]
    fresh: Chunk
    mine: torch.Tensor
    has: torch.Tensor
    step: int
    hypers: list[AdamWHyper] | None
    final: bool
    staged: list[Chunk]


class Copy:
    """Reduced gradients (the stage, or the part a shard was reduce-scattered into) into the fresh grad
    chunk, in its fp32, once they have landed."""

    def __init__(self, out: torch.Tensor, full: torch.Tensor) -> None:
        self.out, self.full = out, full

    def wait(self) -> None:
        self.out.copy_(self.full)
