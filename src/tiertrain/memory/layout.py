"""Where each parameter sits in a chunk, and how big chunks should be.

A chunk holds one block's tensors of one state kind in parameter order, padded so it
splits into equal, aligned shards for a data-parallel group of any given size (sharding
itself comes later; the layout allows it now). The chunk-size search is Elixir's: pack
tensors in order into chunks of capacity C (a tensor never straddles two chunks) and
take the C in the user's range that wastes the fewest bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ALIGN = 64  # elements; 256 B of fp32 per shard boundary, enough for any SIMD width
TENSOR_ALIGN = 32   # elements: each tensor starts 64-byte aligned even in bf16, as torch's allocator
#                     aligns plain tensors, so vectorised kernels take the same paths on our views


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements from the start of the chunk
    numel: int


@dataclass(frozen=True)
class ChunkLayout:
    slots: tuple[Slot, ...]
    numel: int          # padded length in elements
    shard_count: int

    @classmethod
    def build(cls, tensors: list[tuple[str, tuple[int, ...]]], shard_count: int = 1,
              align: int = DEFAULT_ALIGN) -> "ChunkLayout":
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {shard_count}")
        slots, offset = [], 0
        for name, shape in tensors:
            n = 1
            for d in shape:
                n *= d
            offset = -(-offset // TENSOR_ALIGN) * TENSOR_ALIGN
            slots.append(Slot(name, tuple(shape), offset, n))
            offset += n
        unit = shard_count * align
        return cls(tuple(slots), -(-offset // unit) * unit if offset else 0, shard_count)

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shard_count

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Elements [start, end) of the chunk that data-parallel rank ``rank`` owns."""
        if not 0 <= rank < self.shard_count:
            raise ValueError(f"rank {rank} outside 0..{self.shard_count - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def pack(numels: list[int], capacity: int) -> list[list[int]]:
    """Indices of tensors per chunk, packing in order; a new chunk starts when the next tensor does not fit."""
    chunks: list[list[int]] = []
    used = capacity
    for i, n in enumerate(numels):
        if n > capacity:
            raise ValueError(f"tensor {i} has {n} elements, more than the chunk capacity {capacity}")
        if used + n > capacity:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def waste(groups: list[list[int]], capacity: int) -> int:
    """Unused elements over all chunks when every group is packed at ``capacity``."""
    total = 0
    for numels in groups:
        for idx in pack(numels, capacity):
            total += capacity - sum(numels[i] for i in idx)
    return total


def search_chunk_size(groups: list[list[int]], low: int, high: int, step: int, shard_count: int = 1,
                      align: int = DEFAULT_ALIGN) -> tuple[int, int]:
    """(capacity, wasted elements) minimising waste over capacities in [low, high] (Elixir).

    Capacities are multiples of ``shard_count * align`` so every chunk shards evenly; only
    capacities that hold the largest tensor are considered. Ties go to the smaller size.
    """
    unit = shard_count * align
    largest = max((n for g in groups for n in g), default=0)
    best: tuple[int, int] | None = None
    for c in range(low, high + 1, step):
        cap = -(-c // unit) * unit
        if cap < largest:
            continue
        w = waste(groups, cap)
        if best is None or w < best[1] or (w == best[1] and cap < best[0]):
            best = (cap, w)
    if best is None:
        raise ValueError(f"no chunk size in [{low}, {high}] holds the largest tensor ({largest} elements)")
    return best
