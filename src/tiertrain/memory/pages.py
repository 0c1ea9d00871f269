"""Which pages of a pool are free, and which chunks own the rest.

ANGEL-PTM §4.1's layout rule, enforced here: a chunk of at least one page may start in
the partly filled last page of the chunk allocated before it, fills whole pages, and
may end in a partly filled page that the next large chunk can start in. So a page
holds parts of at most two chunks. A chunk smaller than a page gets a page of its own.
Pools that do whole-page I/O (disk) turn sharing off: every chunk starts on a page.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """``length`` bytes at ``offset`` within ``page``."""

    page: int
    offset: int
    length: int


class PagesExhausted(Exception):
    """Raised by the table; the pool turns it into a BudgetError that names the tier."""

    def __init__(self, needed_pages: int) -> None:
        self.needed_pages = needed_pages


class PageTable:
    def __init__(self, n_pages: int, page_size: int, share_pages: bool) -> None:
        self.n_pages, self.page_size, self.share_pages = n_pages, page_size, share_pages
        self._free = bytearray(b"\x01") * n_pages  # 1 = free; bytes.find locates runs in C
        self._owners = [0] * n_pages
        self.free_pages = n_pages
        self._open_tail: tuple[int, int] | None = None  # (page, bytes used) a large chunk may start in

    @property
    def used_pages(self) -> int:
        return self.n_pages - self.free_pages

    def pages_needed(self, nbytes: int) -> int:
        head = self._head_room(nbytes)
        return -(-(nbytes - head) // self.page_size)

    def _head_room(self, nbytes: int) -> int:
        if self.share_pages and self._open_tail is not None and nbytes >= self.page_size:
            return self.page_size - self._open_tail[1]
        return 0

    def allocate(self, nbytes: int, contiguous: bool = False) -> list[Extent]:
        """Extents for ``nbytes``; ``contiguous`` asks for one run of whole pages (for merge)."""
        if nbytes <= 0:
            return []
        ps, head = self.page_size, 0 if contiguous else self._head_room(nbytes)
        n_new = -(-(nbytes - head) // ps)
        if n_new > self.free_pages or (contiguous and self._free.find(b"\x01" * n_new) < 0):
            raise PagesExhausted(n_new)
        extents: list[Extent] = []
        if head:
            page, used = self._open_tail  # type: ignore[misc]
            extents.append(Extent(page, used, head))
            self._owners[page] += 1
            self._open_tail = None
        pages = self._take(n_new, extents[0].page + 1 if extents else None)
        left = nbytes - head
        for page in pages:
            take = min(ps, left)
            extents.append(Extent(page, 0, take))
            self._owners[page] = 1
            left -= take
        last = extents[-1]
        if self.share_pages and not contiguous and nbytes >= ps and last.offset == 0 and last.length < ps:
            self._open_tail = (last.page, last.length)
        return extents

    def _take(self, n: int, prefer: int | None) -> list[int]:
        """n free pages: a run starting at ``prefer`` if free, else the first run, else any."""
        if n == 0:
            return []
        run = b"\x01" * n
        if prefer is not None and self._free[prefer : prefer + n] == run:
            start = prefer
        else:
            start = self._free.find(run)
        if start >= 0:
            pages = list(range(start, start + n))
        else:
            pages = [i for i, f in enumerate(self._free) if f][:n]
        for p in pages:
            self._free[p] = 0
        self.free_pages -= n
        return pages

    def release(self, extents: list[Extent]) -> None:
        for e in extents:
            self._owners[e.page] -= 1
            assert self._owners[e.page] >= 0, f"page {e.page} released twice"
            if self._owners[e.page] == 0:
                self._free[e.page] = 1
                self.free_pages += 1
                if self._open_tail is not None and self._open_tail[0] == e.page:
                    self._open_tail = None

    def owners(self, page: int) -> int:
        return self._owners[page]
