"""Which pages of a pool are free, and which chunks own the rest.

ANGEL-PTM §4.1's layout rule, enforced here: a chunk of at least one page may start in
the partly filled last page of the chunk allocated before it, fills whole pages, and
may end in a partly filled page that the next large chunk can start in. So a page
holds parts of at most two chunks. A chunk smaller than a page gets a page of its own.
Pools that do whole-page I/O (disk) turn sharing off: every chunk starts on a page.
"""

from __future__ import annotations

import bisect
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
    """Free and owned pages, in memory proportional to the pages in use, not to the budget: a
    1000 TiB budget (or 100 TiB of 4 KiB pages) costs nothing until its pages are taken.

    Pages at or past ``_frontier`` have never been handed out; ``_holes`` are the sorted, disjoint
    ``[start, end)`` runs freed below it (a hole never touches the frontier: it lowers it instead).
    Allocation is first fit in address order, as a scan of a free bitmap would be."""

    def __init__(self, n_pages: int, page_size: int, share_pages: bool) -> None:
        self.n_pages, self.page_size, self.share_pages = n_pages, page_size, share_pages
        self._owners: dict[int, int] = {}
        self._frontier = 0
        self._holes: list[list[int]] = []
        self.free_pages = n_pages
        self._open_tail: tuple[int, int] | None = None  # (page, bytes used) a large chunk may start in

    @property
    def used_pages(self) -> int:
        return self.n_pages - self.free_pages

    def _head_room(self, nbytes: int) -> int:
        if self.share_pages and self._open_tail is not None and nbytes >= self.page_size:
            return self.page_size - self._open_tail[1]
        return 0

    def allocate(self, nbytes: int, contiguous: bool = False, top: bool = False) -> list[Extent]:
        """Extents for ``nbytes``; ``contiguous`` asks for one run of whole pages (for merge); ``top``
        for the last such run in address order: a size class of its own kept at the far end, so
        the holes it leaves never split the runs the others need (``Runtime._grad_floors``)."""
        if nbytes <= 0:
            return []
        contiguous = contiguous or top
        ps, head = self.page_size, 0 if contiguous else self._head_room(nbytes)
        n_new = -(-(nbytes - head) // ps)
        start = self._find_run_top(n_new) if top else self._find_run(n_new) if contiguous else None
        if n_new > self.free_pages or (contiguous and start is None):
            raise PagesExhausted(n_new)
        extents: list[Extent] = []
        if head:
            page, used = self._open_tail  # type: ignore[misc]
            extents.append(Extent(page, used, head))
            self._owners[page] += 1
            self._open_tail = None
        pages = self._take(n_new, start if top else extents[0].page + 1 if extents else None)
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

    def _is_free_run(self, start: int, n: int) -> bool:
        if start >= self._frontier:
            return start + n <= self.n_pages
        i = bisect.bisect_right(self._holes, [start, self.n_pages + 1]) - 1
        return i >= 0 and self._holes[i][0] <= start and start + n <= self._holes[i][1]

    def _find_run(self, n: int) -> int | None:
        """The first free run of ``n`` pages, in address order."""
        for lo, hi in self._holes:
            if hi - lo >= n:
                return lo
        return self._frontier if self._frontier + n <= self.n_pages else None

    def _find_run_top(self, n: int) -> int | None:
        """The start of the last free run of ``n`` pages, in address order."""
        if self._frontier + n <= self.n_pages:
            return self.n_pages - n
        for lo, hi in reversed(self._holes):
            if hi - lo >= n:
                return hi - n
        return None

    def _take(self, n: int, prefer: int | None) -> list[int]:
        """n free pages: a run starting at ``prefer`` if free, else the first run, else any."""
        if n == 0:
            return []
        start = prefer if prefer is not None and self._is_free_run(prefer, n) else self._find_run(n)
        if start is not None:
            pages = list(range(start, start + n))
        else:  # scattered: the lowest free pages
            pages = [p for lo, hi in self._holes for p in range(lo, hi)][:n]
            pages += range(self._frontier, self._frontier + n - len(pages))
        for p in pages:
            self._mark_used(p)
        self.free_pages -= n
        return pages

    def _mark_used(self, page: int) -> None:
        if page >= self._frontier:
            if page > self._frontier:  # the pages skipped over become a hole
                self._holes.append([self._frontier, page])
            self._frontier = page + 1
            return
        i = bisect.bisect_right(self._holes, [page, self.n_pages + 1]) - 1
        lo, hi = self._holes[i]
        replacement = [r for r in ([lo, page], [page + 1, hi]) if r[1] > r[0]]
        self._holes[i : i + 1] = replacement

    def _mark_free(self, page: int) -> None:
        i = bisect.bisect_left(self._holes, [page, page])
        left = self._holes[i - 1] if i > 0 and self._holes[i - 1][1] == page else None
        right = self._holes[i] if i < len(self._holes) and self._holes[i][0] == page + 1 else None
        if left and right:
            left[1] = right[1]
            del self._holes[i]
        elif left:
            left[1] = page + 1
        elif right:
            right[0] = page
        else:
            self._holes.insert(i, [page, page + 1])
        if self._holes and self._holes[-1][1] == self._frontier:  # a hole reaching the frontier lowers it
            self._frontier = self._holes.pop()[0]

    def release(self, extents: list[Extent]) -> None:
        for e in extents:
            left = self._owners[e.page] - 1
            assert left >= 0, f"page {e.page} released twice"
            if left:
                self._owners[e.page] = left
                continue
            del self._owners[e.page]
            self._mark_free(e.page)
            self.free_pages += 1
            if self._open_tail is not None and self._open_tail[0] == e.page:
                self._open_tail = None

    def owners(self, page: int) -> int:
        return self._owners.get(page, 0)
