"""How fast a disk moves pages the way the disk tier moves them, and what that costs the cores.

O_DIRECT (buffered where the filesystem refuses it), one request per page, ``in_flight``
requests at once, writes then reads of a private temporary file. One measurement serves
the page-size picker (bandwidth and CPU cost per page size), the planner's machine probe
(read and write rates, with the tier's checksums) and the memory benchmark's raw limit.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tiertrain.errors import ConfigError, DiskError
from tiertrain.memory.disk import checksum, make_disk_dir
from tiertrain.units import format_bytes
from tiertrain.memory.pool import host_buffer


@dataclass(frozen=True)
class DiskRates:
    read_bps: float
    write_bps: float
    cpu_s_per_byte: float  # process CPU seconds per byte moved (syscalls, pinning, workers, checksums)

    @property
    def both_bps(self) -> float:
        """Bytes per second over a write and a read of the same bytes."""
        return 2 / (1 / self.read_bps + 1 / self.write_bps)


@contextmanager
def probe_file(directory: Path, nbytes: int) -> Iterator[int]:
    """A private temporary file under ``directory``, opened for O_DIRECT (buffered where the filesystem
    refuses it) and removed afterwards; an OSError while measuring becomes one DiskError saying why."""
    try:
        make_disk_dir(directory)
        fd, path = tempfile.mkstemp(dir=directory, prefix=".tiertrain-probe-")
    except OSError as exc:
        raise ConfigError(f"disk directory {directory} cannot be written ({exc.strerror}); "
                          "name a writable directory with --disk") from None
    os.close(fd)
    fd = -1
    try:
        fd = _open_direct(path)
        yield fd
    except OSError as exc:  # a full or failing disk: the probe's file goes, the user learns why
        raise DiskError(f"measuring the disk under {directory} failed ({exc.strerror}): the probe writes "
                        f"{format_bytes(nbytes)}; free space there, or give --page-size to skip the measurement") from None
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def measure_disk(directory: Path, page: int, total: int, in_flight: int, verify: bool = False) -> DiskRates:
    """``verify``: checksum every page written and read, as the disk tier does."""
    buffers = [host_buffer(page, pin=False) for _ in range(in_flight)]  # (tensor, its mapping): keep both
    views = [memoryview(b.random_(0, 256).numpy()) for b, _ in buffers]
    n = max(in_flight, total // page)
    with probe_file(directory, n * page) as fd:
        def write(i: int) -> None:
            if verify:
                checksum(views[i % in_flight])
            os.pwrite(fd, views[i % in_flight], i * page)

        def read(i: int) -> None:
            os.preadv(fd, [views[i % in_flight]], i * page)
            if verify:
                checksum(views[i % in_flight])

        with ThreadPoolExecutor(in_flight) as pool:
            cpu, t = time.process_time(), time.perf_counter()
            list(pool.map(write, range(n)))
            os.fsync(fd)
            write_s = time.perf_counter() - t
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # buffered fallback: read from the disk
            t = time.perf_counter()
            list(pool.map(read, range(n)))
            read_s = time.perf_counter() - t
            cpu_s = time.process_time() - cpu
    nbytes = n * page
    return DiskRates(nbytes / read_s, nbytes / write_s, cpu_s / (2 * nbytes))


def _open_direct(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:  # no O_DIRECT on this filesystem: the tier falls back to buffered I/O, as here
        return os.open(path, os.O_RDWR)
