"""Give the C heap's free memory back to the operating system.

Why by hand: glibc keeps what a process frees inside its heap and per-thread arenas, and raises
its mmap threshold after each large free, so later buffers of tens of MB come from the heap and
stay there once freed. A checkpoint streams a tiered model block by block through such buffers
(a block's master, then its moments); under a memory cap the retained memory is what got the run
killed. Measured on the cgroup test's 482M-param model (first run, one step and a checkpoint):
peak RSS 1000 MB without, 768 MB with ``malloc_trim`` after each block. Making glibc map every
buffer of 1 MiB or more instead (``M_MMAP_THRESHOLD``) reached 782 MB but slowed plain training
by page faults on every activation, so only the places that stream blocks trim.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl and macOS have none
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the heap's free pages to the OS (a no-op where the C library cannot)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
