"""How many requests the disk tier keeps in flight, and whether reads and writes go in together:
measured per disk and page size, as the page size is (``page_size``), and cached.

Depth: the disk tier's page requests written then read back with 2, 4 and 8 in flight; the smallest depth
whose rate is within 90% of the best (more threads past the plateau only cost the cores). Together:
at that depth, half the requests reads and half writes at once, against the same bytes read and
written one after the other. Some disks serve both at once faster than either alone (an SSD's
separate read and write paths); others slow down. Where together is at least ``TOGETHER_GAIN``
faster, the disk tier lets half its workers take write-backs while reads wait (``io_queue``); else
reads go first, as before.

Both are measured with a thread running Python beside the requests, as a step's main thread runs the
model's modules and hooks: each finished request's worker then waits for the interpreter's lock
before it issues the next, and only more requests in flight keep the disk busy meanwhile. Measured
idle at 4 MiB pages, this disk's curve was flat from 2 in flight and runs took 2; with Python beside,
2 in flight moved 0.53 GB/s read and 0.73 written, 8 moved 1.0-1.2. The 354M disk plan's step (six
runs at 2 workers, eight at 6, two at 8, alternated): 4.55-6.52 s at 2, 4.23-4.97 s at 6, 4.48 and 4.53 s
at 8 (the README, where it says how many requests are in flight).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tiertrain.measure import cache
from tiertrain.measure.disk import measure_disk, probe_file
from tiertrain.errors import ConfigError, DiskError
from tiertrain.memory.pool import host_buffer
from tiertrain.parallel.agree import from_rank0

# Never one: a read on the step's critical path would wait behind a write-back. Never past 8: beside a
# thread that only runs Python the curve rose on to 16 (2 MiB pages: 1.00 GB/s at 8, 1.37 at 16), but a
# step's Python lets go of the lock in every op, and the 354M disk plan ran slower at 16 (5.46, 5.48 s a
# step in the peers bench) than at 8 (4.82, 4.97 s), each worker a thread on the same two cores.
DEPTHS = (2, 4, 8)
PLATEAU = 0.90  # beside Python the curve is noisy: a 5% band picked 8, 16 and 32 in three measurements of one disk
TOGETHER_GAIN = 1.10
# per pass: beside Python each request waits for the interpreter's lock, so a pass's time goes with its
# requests: 2048 of 64 KiB took 95 s over the whole measurement, 256 took 13 s (at 1 MiB, 18 s either way)
MAX_REQUESTS = 256
MiB = 1 << 20
log = logging.getLogger("tiertrain")


@dataclass(frozen=True)
class DiskDepth:
    depth: int                      # requests in flight (the disk tier's I/O workers)
    write_share: int                # of those, how many may take write-backs while reads wait (0: reads first)
    curve: dict[int, float]         # depth -> bytes/s, written then read
    together_bps: float             # reads and writes at once, at ``depth``
    apart_bps: float                # the same bytes read and written one after the other

    def describe(self) -> str:
        way = f"{self.write_share} of them may write while reads wait" if self.write_share else "reads first"
        return (f"disk depth {self.depth} ({way}; together {self.together_bps / 1e9:.2f} GB/s, "
                f"apart {self.apart_bps / 1e9:.2f} GB/s)")


def plateau_depth(curve: dict[int, float]) -> int:
    """The smallest depth within ``PLATEAU`` of the best rate measured."""
    best = max(curve.values())
    return min(d for d, bps in curve.items() if bps >= PLATEAU * best)


def choose(curve: dict[int, float], together_bps: float, apart_bps: float) -> tuple[int, int]:
    """(depth, write share) from the measurements (``DiskDepth``'s rules)."""
    depth = plateau_depth(curve)
    share = depth // 2 if together_bps >= TOGETHER_GAIN * apart_bps and depth > 1 else 0
    return depth, share


def together_rate(directory: Path, page: int, total: int, depth: int) -> tuple[float, float]:
    """(bytes/s with half of ``depth`` reading and half writing at once, bytes/s for the same bytes
    read and then written): one file, its first half read while its second half is written."""
    n = max(2, total // page // 2 * 2)
    buffers = [host_buffer(page, pin=False) for _ in range(depth)]
    views = [memoryview(b.random_(0, 256).numpy()) for b, _ in buffers]
    half = n // 2
    with probe_file(directory, n * page) as fd:
        for i in range(n):  # the file's pages exist before anything reads them
            os.pwrite(fd, views[i % depth], i * page)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def read(i: int) -> None:
            os.preadv(fd, [views[i % depth]], i * page)

        def write(i: int) -> None:
            os.pwrite(fd, views[i % depth], (half + i) * page)

        with ThreadPoolExecutor(max(1, depth // 2)) as readers, ThreadPoolExecutor(max(1, depth - depth // 2)) as writers:
            t = time.perf_counter()
            done = [writers.submit(write, i) for i in range(half)] + [readers.submit(read, i) for i in range(half)]
            for f in done:
                f.result()
            os.fsync(fd)
            together_s = time.perf_counter() - t
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with ThreadPoolExecutor(depth) as pool:
            t = time.perf_counter()
            list(pool.map(read, range(half)))
            list(pool.map(write, range(half)))
            os.fsync(fd)
            apart_s = time.perf_counter() - t
    return 2 * half * page / together_s, 2 * half * page / apart_s


@contextmanager
def python_beside() -> Iterator[None]:
    """A thread running Python (holding the interpreter's lock but for its switch interval) while the
    block runs: what a training step's main thread does to the disk tier's workers."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, name="tiertrain-depth-python", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure_depth(directory: Path, page: int, total: int = 256 * MiB, rounds: int = 2) -> DiskDepth:
    """Each depth measured ``rounds`` times, interleaved, its best kept (a shared disk is noisy), with
    the tier's checksums on every page (they run on the I/O workers, so more of them spread that CPU
    work too) and Python running beside them (``python_beside``)."""
    total = min(total, MAX_REQUESTS * page)  # small pages: a bounded count of requests, not of bytes
    curve = {d: 0.0 for d in DEPTHS}
    with python_beside():
        for _ in range(rounds):
            for d in DEPTHS:
                curve[d] = max(curve[d], measure_disk(directory, page, total, d, verify=True).both_bps)
        rates = [together_rate(directory, page, total, plateau_depth(curve)) for _ in range(rounds)]
    together, apart = max(r[0] for r in rates), max(r[1] for r in rates)  # each at its best, as the curve
    depth, share = choose(curve, together, apart)
    return DiskDepth(depth, share, curve, together, apart)


def measured_depth(disk_dir: str, page: int, total: int = 256 * MiB) -> DiskDepth:
    """The cached depth for this disk and page size, measuring it if needed (12-20 s here, once)."""
    key = f"v3/{socket.gethostname()}/disk:{os.stat(disk_dir).st_dev}/{page}"  # v3: beside Python, at most 8
    known = cache.load("disk_depth", key)
    if isinstance(known, dict):
        try:
            curve = {int(k): float(v) for k, v in known["curve"].items()}
            return DiskDepth(int(known["depth"]), int(known["write_share"]), curve, float(known["together_bps"]),
                             float(known["apart_bps"]))
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: measured again
    print(f"tiertrain: measuring how many requests the disk under {disk_dir} wants in flight at {page >> 10} KiB pages "
          "(once per disk and page size; cached)...", file=sys.stderr, flush=True)
    found = measure_depth(Path(disk_dir), page, total)
    print(f"  {found.describe()}", file=sys.stderr, flush=True)
    cache.store("disk_depth", key, {"depth": found.depth, "write_share": found.write_share,
                                    "curve": {str(k): v for k, v in found.curve.items()},
                                    "together_bps": found.together_bps, "apart_bps": found.apart_bps})
    return found


@dataclass(frozen=True)
class DiskIO:
    """How a run's disk tier uses its disk (``MemorySystem``'s I/O workers), and what the planner's
    simulator takes from it (``MachineProfile.disk_together_gain``)."""
    depth: int                  # requests in flight
    write_share: int = 0        # of those, how many may write while reads wait (0: reads first)
    together_gain: float = 1.0  # reads and writes at once against in turns, where they go at once; else 1


DEFAULT_IO = DiskIO(8)  # BENCHMARKS.md: deeper queues than ~8 were no faster on these disks; reads first
DEPTH_WORTH = 32 << 20  # states below this move in well under a second at any depth: not worth 12-20 s measuring
STATE_BYTES = 12  # fp32 master and two moments a parameter: what a disk tier moves


def depth_worth_measuring(states_bytes: int) -> bool:
    """Whether a run whose states (master and moments) take ``states_bytes`` measures its disk's depth, or
    keeps the defaults (``DEFAULT_IO``: no gain for reads and writes at once); ``tiertrain plan`` asks the same."""
    return states_bytes >= DEPTH_WORTH


def disk_io_for(measured_page: bool, disk_dir: str | None, page: int, states_bytes: int = DEPTH_WORTH) -> DiskIO:
    """A run's disk I/O: measured for its disk where its page size was measured too (a run that names
    its page size, as the tests do, measures neither) and its states are worth it (``depth_worth_measuring``),
    else the defaults. Over several ranks, rank 0's, decided there: measured once, not by every rank of a
    host at once on one disk (each would find it slower than it is); the ranks of other hosts take it as
    they take its page size."""
    measured_page = measured_page and depth_worth_measuring(states_bytes)
    return from_rank0("the disk's depth", lambda: _local_io(measured_page, disk_dir, page),
                      lambda io: json.dumps(dataclasses.asdict(io)), lambda text: DiskIO(**json.loads(text)))


def _local_io(measured_page: bool, disk_dir: str | None, page: int) -> DiskIO:
    given = os.environ.get("TIERTRAIN_IO_WORKERS")  # an override, for comparing depths on one disk
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ConfigError(f"TIERTRAIN_IO_WORKERS={given!r} must be a whole number of workers, 1 or more")
        return DiskIO(int(given))
    if not measured_page or not disk_dir:
        return DEFAULT_IO
    return _io_or_default(disk_dir, page)


def together_gain(disk_dir: str, page: int) -> float:
    """How much faster this disk moves reads and writes at once than in turns at ``page``, as a run's
    disk tier would use it (measured once per disk and page size, cached); 1 where it takes turns."""
    return _io_or_default(disk_dir, page).together_gain


def _io_or_default(disk_dir: str, page: int) -> DiskIO:
    try:
        found = measured_depth(disk_dir, page)
    except DiskError as exc:  # the tier's own checks report a failing disk; the run need not stop here
        log.warning("measuring the disk's depth failed (%s); using %d workers, reads first", exc, DEFAULT_IO.depth)
        return DEFAULT_IO
    gain = found.together_bps / found.apart_bps if found.write_share else 1.0
    return DiskIO(found.depth, found.write_share, max(1.0, gain))
