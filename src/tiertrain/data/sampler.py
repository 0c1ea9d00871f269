"""Deterministic, resumable batch sampling.

Batch number k is a pure function of (seed, k): its offsets come from a generator
seeded with both. Resuming therefore needs only the number of batches already drawn,
and a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tiertrain.errors import DataError


@dataclass
class BatchSampler:
    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    position: int = 0  # batches drawn so far, over all ranks; saved in checkpoints
    rank: int = 0      # data parallel: this rank draws batches position + rank, then every world-th
    world: int = 1

    def __post_init__(self) -> None:
        need = self.batch_size * (self.seq_len + 1)
        if len(self.tokens) < need:
            raise DataError(
                f"data has {len(self.tokens)} tokens, shorter than one batch of "
                f"{self.batch_size} x {self.seq_len + 1} = {need}; "
                "use more data or a smaller --batch-size / --seq-len"
            )

    def batch_at(self, k: int) -> torch.Tensor:
        """Batch number k: (batch_size, seq_len + 1) int64 tokens."""
        rng = np.random.default_rng([self.seed, k])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        rows = [np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))

    def next(self) -> torch.Tensor:
        """This rank's next batch: of the run's sequence of batches, the ranks take turns, so a run of
        any world size draws the same sequence (and resumes from its position at another size)."""
        batch = self.batch_at(self.position + self.rank)
        self.position += self.world
        return batch
