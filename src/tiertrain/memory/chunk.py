"""A chunk: one block's state of one kind, a flat logical buffer made of one tier's pages.

The chunk is the unit of transfer (and later of collectives). Its bytes are a list of
extents; ``segments`` maps a logical byte range onto them, ``merge`` makes it contiguous
when a kernel needs one flat tensor (ANGEL-PTM's Tensor.merge), without leaving the
tier's budget.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

import torch

from tiertrain.memory.pages import Extent
from tiertrain.plan.tiers import Kind, Tier

if TYPE_CHECKING:
    from tiertrain.memory.movement import Handle
    from tiertrain.memory.pool import Pool


class Chunk:
    def __init__(self, name: str, kind: Kind, nbytes: int, pool: "Pool", extents: list[Extent]) -> None:
        self.name, self.kind, self.nbytes = name, kind, nbytes
        self.pool, self.extents = pool, extents
        self.pending: "Handle | None" = None
        self.released = False
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Chunk({self.name!r}, {self.kind.value}, {self.nbytes} B on {self.tier.value})"

    @property
    def tier(self) -> Tier:
        return self.pool.tier

    def check_usable(self) -> None:
        if self.released:
            raise RuntimeError(f"{self!r} was released")
        if self.pending is not None and not self.pending.done():
            raise RuntimeError(f"{self!r} is moving; wait() on its handle before touching its bytes")

    def segments(self, start: int = 0, end: int | None = None) -> Iterator[tuple[int, Extent]]:
        """(logical offset, extent piece) for the bytes in [start, end), in order."""
        end = self.nbytes if end is None else end
        pos = 0
        for e in self.extents:
            lo, hi = max(start, pos), min(end, pos + e.length)
            if lo < hi:
                yield lo, Extent(e.page, e.offset + lo - pos, hi - lo)
            pos += e.length
            if pos >= end:
                break

    def is_contiguous(self) -> bool:
        ps = self.pool.page_size
        return all(a.page * ps + a.offset + a.length == b.page * ps + b.offset
                   for a, b in zip(self.extents, self.extents[1:]))

    def views(self) -> list[torch.Tensor]:
        """The chunk's bytes as uint8 views of the pool, one per extent (memory tiers only)."""
        self.check_usable()
        if self.tier is Tier.DISK:
            raise RuntimeError(f"{self!r} is on disk; move it to host or device to see its bytes")
        return [self.pool.view(e) for e in self.extents]  # type: ignore[attr-defined]

    def merge(self) -> torch.Tensor:
        """One contiguous uint8 view of the chunk: free if already contiguous, else one copy
        into a fresh run of pages of the same tier (so merging never exceeds the budget)."""
        self.check_usable()
        if self.tier is Tier.DISK:
            raise RuntimeError(f"{self!r} is on disk; move it to host or device to merge it")
        if not self.is_contiguous():
            fresh = self.pool.allocate(self.nbytes, contiguous=True)
            dst = self.pool.view(Extent(fresh[0].page, 0, self.nbytes))  # type: ignore[attr-defined]
            for pos, e in self.segments():
                dst[pos : pos + e.length].copy_(self.pool.view(e))  # type: ignore[attr-defined]
            self.pool.release(self.extents)
            self.extents = fresh
        if not self.extents:
            return torch.empty(0, dtype=torch.uint8)
        first = self.extents[0]
        return self.pool.view(Extent(first.page, first.offset, self.nbytes))  # type: ignore[attr-defined]

    def typed(self, dtype: torch.dtype, offset: int = 0, numel: int | None = None) -> torch.Tensor:
        """A typed view into the merged chunk: ``numel`` elements of ``dtype`` from byte ``offset``."""
        flat = self.merge()
        size = dtype.itemsize
        numel = (self.nbytes - offset) // size if numel is None else numel
        return flat[offset : offset + numel * size].view(dtype)
