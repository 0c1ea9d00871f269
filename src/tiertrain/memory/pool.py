"""One tier's memory, reserved once at start and handed out in pages.

The reservation is the budget (or, for the device, the plan's count of it: ``MemorySystem``'s
``device_reserve``) rounded down to whole pages; the pool never grows. An allocation past the
budget raises a BudgetError naming the tier, the bytes needed and the budget; one past a count
short of the budget, a RuntimeError (the count was wrong). Nothing spills to another tier on its
own: the caller decides where bytes live.
"""

from __future__ import annotations

import logging
import mmap
import platform
import sys
import threading
import weakref

import torch

from tiertrain.errors import BudgetError, ConfigError
from tiertrain.memory.pages import Extent, PagesExhausted, PageTable
from tiertrain.plan.tiers import Tier
from tiertrain.units import format_bytes

log = logging.getLogger(__name__)

IO_ALIGN = 4096  # O_DIRECT needs buffers, offsets and lengths aligned to the logical block size
DEFAULT_PAGE_SIZE = 1 << 20  # for a MemorySystem made without one; runs measure theirs (engine.measure.page_size)


def check_page_size(size: int) -> int:
    """A page size the pools can use: a positive multiple of the O_DIRECT alignment."""
    if size < IO_ALIGN or size % IO_ALIGN:
        raise ConfigError(f"page size {size} must be a positive multiple of {IO_ALIGN} bytes (e.g. 4MiB)")
    return size


class Pool:
    def __init__(self, tier: Tier, budget: int, page_size: int, share_pages: bool, reserve: int | None = None) -> None:
        """``reserve``: the bytes mapped, where less than the budget (``MemorySystem``'s device_reserve)."""
        if page_size % IO_ALIGN:
            raise ValueError(f"page size {page_size} must be a multiple of {IO_ALIGN}")
        self.tier, self.budget, self.page_size = tier, budget, page_size
        self.short_of_budget = reserve is not None and reserve < budget
        self.n_pages = (min(reserve, budget) if reserve is not None else budget) // page_size
        self.table = PageTable(self.n_pages, page_size, share_pages)
        self._lock = threading.Lock()
        self.peak_bytes = 0  # most page bytes ever in use: what the budget bounds

    @property
    def capacity(self) -> int:
        return self.n_pages * self.page_size

    @property
    def used_bytes(self) -> int:
        return self.table.used_pages * self.page_size

    def allocate(self, nbytes: int, contiguous: bool = False, top: bool = False) -> list[Extent]:
        with self._lock:
            try:
                extents = self.table.allocate(nbytes, contiguous, top)
            except PagesExhausted as exc:
                if self.short_of_budget:  # the plan's count was short, not the user's budget
                    raise RuntimeError(
                        f"the {self.tier.value} pool holds the {format_bytes(self.capacity)} the plan counts (its "
                        f"budget {format_bytes(self.budget)}, the rest left for activations) and cannot hold "
                        f"{format_bytes(exc.needed_pages * self.page_size)} more "
                        f"({format_bytes(self.used_bytes)} in use): the plan's count is short, a bug in tiertrain; "
                        "please report it") from None
                raise BudgetError(self.tier.value, exc.needed_pages * self.page_size, self.budget,
                                  self.used_bytes) from None
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return extents

    def release(self, extents: list[Extent]) -> None:
        with self._lock:
            self.table.release(extents)

    def close(self) -> None:
        """Give the reservation back; the pool is unusable afterwards."""


# Python's mmap names MAP_NORESERVE from 3.13; Linux's value on x86-64 and arm64 (elsewhere: not set)
_NORESERVE = getattr(mmap, "MAP_NORESERVE",
                     0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0)


def host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, "HostRegion | None"]:
    """Page-aligned host memory (so any page of it can be an O_DIRECT buffer), pinned with CUDA;
    keep the region beside the tensor for as long as the memory must stay pinned.

    We map anonymous memory ourselves instead of ``torch.empty(pin_memory=True)``: the
    caching pinned allocator rounds to powers of two (a 40 GiB budget would pin 64 GiB) and
    does not promise the 4 KiB alignment O_DIRECT needs. ``MAP_NORESERVE``: the budget was
    already held against the machine (``memory.capacity``), and a reservation the kernel
    counts is counted again at every ``fork`` (a DataLoader's workers, a multiprocessing
    manager): a process holding budgets near the machine's memory could then not fork at all.
    Under strict overcommit (mode 2) the kernel ignores the flag and counts it as before.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), None
    region = HostRegion(nbytes, pin)
    return region.tensor, region


class HostRegion:
    """An anonymous private mapping, pinned for CUDA where asked, and unpinned before it can be unmapped.

    Memory unmapped while still registered stays in CUDA's table, and the next mapping the kernel puts
    at that address cannot be registered (error 712, "already registered", or a sticky "resource
    already mapped" at a later CUDA call: seen on an H100, where a page-size probe's pinned buffer,
    dropped registered, broke the host pool made after it). So the pin is undone by ``unpin`` (a
    pool's close) or when this object is collected, whichever comes first; the finalizer holds the
    mapping, so the mapping outlives its pin. Views of ``tensor`` keep the mapping, not the pin."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        try:
            self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        except OSError as exc:  # the kernel refused the reservation (overcommit limits)
            raise BudgetError("host", nbytes, nbytes, 0, detail=f"the kernel refused to map it ({exc.strerror})") from None
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = False
        self._unpin: weakref.finalize | None = None
        if pin:
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if err != 0:
                raise RuntimeError(f"pinning {nbytes} bytes of host memory for CUDA (cudaHostRegister) failed with "
                                   f"CUDA error {err}")
            self.pinned = True
            self._unpin = weakref.finalize(self, _unregister, self.tensor.data_ptr(), self.map)
            self._unpin.atexit = False  # the process's end unpins everything, and CUDA may be gone by then

    def unpin(self) -> None:
        """Unpin now (a pool's close), not when collected; the mapping stays while views of it live."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False

    def give_back(self) -> None:
        """Return the pages to the OS now, whatever views still point here (they then read zeros)."""
        self.map.madvise(mmap.MADV_DONTNEED)


def _unregister(ptr: int, mapping: mmap.mmap) -> None:
    """Unpin; ``mapping`` is only held, so that it is unmapped after this, never before."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        log.warning("unpinning host memory at %#x failed with CUDA error %d", ptr, err)


class MemoryPool(Pool):
    """Device or host memory: one buffer, pages are slices of it.

    On a CPU-only machine the device tier is CPU memory under its own budget, so every
    code path above runs and is tested without an accelerator.
    """

    def __init__(self, tier: Tier, budget: int, page_size: int, device: torch.device,
                 reserve: int | None = None) -> None:
        super().__init__(tier, budget, page_size, share_pages=True, reserve=reserve)
        self.device = device
        self.pinned = device.type == "cpu" and tier is Tier.HOST and torch.cuda.is_available()
        if device.type == "cuda":
            self.buffer, self._region = torch.empty(self.capacity, dtype=torch.uint8, device=device), None
        else:
            self.buffer, self._region = host_buffer(self.capacity, pin=self.pinned)

    def view(self, e: Extent) -> torch.Tensor:
        start = e.page * self.page_size + e.offset
        return self.buffer[start : start + e.length]

    def close(self) -> None:
        if self._region is not None:
            self._region.unpin()
        self.buffer = torch.empty(0, dtype=torch.uint8)
        # The mmap is unmapped when the last view of it is gone; closing it here would fail
        # while a caller still holds a view, and a model's parameters (views of its slots) often
        # live on in a reference cycle until the garbage collector's next full pass. Its pages
        # are given back to the OS now: the memory is free at close, whatever still points at it
        # (a view read after close sees zeros).
        if self._region is not None:
            self._region.give_back()
        self._region = None
