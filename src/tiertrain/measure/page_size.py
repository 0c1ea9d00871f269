"""The default page size: measured, not guessed (ANGEL-PTM §4.1).

We time copies of several page sizes over the slowest link a run uses (disk when it has
a disk tier, else host<->device with CUDA, else a memory copy) with as many requests in
flight as the mover uses, and take the smallest size reaching 95% of the plateau. For a
disk, also no smaller than the smallest size within 25% of the cheapest in CPU time per
byte: small requests can reach the disk's bandwidth and still cost the cores twice as much
per byte (measured here: 0.25-0.4 CPU-s per GB at 1 MiB, 0.16 at 4-16 MiB), time that the
CPU optimizer, or on a CPU-only machine the compute itself, loses. The result is cached
per machine and link, so only the first run pays for the measurement.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import torch

from tiertrain.measure import cache
from tiertrain.measure.disk import measure_disk
from tiertrain.errors import ConfigError
from tiertrain.memory.disk import make_disk_dir
from tiertrain.memory.pool import check_page_size, host_buffer
from tiertrain.parallel.agree import from_rank0

KiB, MiB = 1024, 1024 * 1024
CANDIDATES = [64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
PLATEAU_FRACTION = 0.95
CPU_SLACK = 1.25


def pick(curve: dict[int, float], fraction: float = PLATEAU_FRACTION) -> int:
    """Smallest size whose bandwidth reaches ``fraction`` of the best measured."""
    best = max(curve.values())
    return min(size for size, bw in curve.items() if bw >= fraction * best)


def pick_cheap(cpu: dict[int, float], slack: float = CPU_SLACK) -> int:
    """Smallest size whose CPU seconds per byte are within ``slack`` of the cheapest measured."""
    best = min(cpu.values())
    return min(size for size, c in cpu.items() if c <= slack * best)


def disk_curve(directory: Path, total: int = 256 * MiB, workers: int = 8,
               cpu: dict[int, float] | None = None) -> dict[int, float]:
    """Write-then-read bandwidth (bytes/s) of O_DIRECT page requests, ``workers`` in flight.
    ``cpu``, when given, receives the CPU seconds each byte cost (syscalls, pinning pages, the
    workers' own overhead): time the optimizer, or on a CPU-only machine the compute, loses."""
    curve = {}
    for size in CANDIDATES:
        rates = measure_disk(directory, size, total, workers)
        curve[size] = rates.both_bps
        if cpu is not None:
            cpu[size] = rates.cpu_s_per_byte
    return curve


def memory_curve(device: torch.device, total: int = 256 * MiB) -> dict[int, float]:
    """Host->device (pinned, with CUDA) or host->host copy bandwidth per page size."""
    src, _r1 = host_buffer(total, pin=device.type == "cuda")
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    curve = {}
    for size in CANDIDATES:
        t = time.perf_counter()
        for off in range(0, total - size + 1, size):
            if device.type == "cuda":
                dst[off : off + size].copy_(src[off : off + size], non_blocking=True)
            else:
                np.copyto(dst[off : off + size].numpy(), src[off : off + size].numpy())
        if device.type == "cuda":
            torch.cuda.synchronize()
        curve[size] = (total // size) * size / (time.perf_counter() - t)
    return curve


def _page_key(disk_dir: str | None, device: torch.device) -> str:
    if disk_dir:
        try:
            make_disk_dir(Path(disk_dir))
        except OSError as exc:
            raise ConfigError(f"disk directory {disk_dir} cannot be created ({exc.strerror}); name another with --disk") from None
        link = f"disk:{os.stat(disk_dir).st_dev}"
    else:
        link = "h2d:cuda" if device.type == "cuda" else "memcpy"
    return f"v3/{socket.gethostname()}/{link}"


def known_page_size(disk_dir: str | None, device: torch.device) -> int | None:
    """The page size measured for this machine's slowest link in use, if it was; never measures."""
    known = cache.load("page_size", _page_key(disk_dir, device))
    return known["page_size"] if isinstance(known, dict) and isinstance(known.get("page_size"), int) else None


def measured_page_size(disk_dir: str | None, device: torch.device) -> int:
    """The cached page size for this machine's slowest link in use, measuring it if needed."""
    key = _page_key(disk_dir, device)
    known = cache.load("page_size", key)
    if isinstance(known, dict) and isinstance(known.get("page_size"), int):
        return known["page_size"]
    cpu: dict[int, float] = {}
    curve = disk_curve(Path(disk_dir), cpu=cpu) if disk_dir else memory_curve(device)
    size = max(pick(curve), pick_cheap(cpu)) if cpu else pick(curve)
    cache.store("page_size", key, {"page_size": size, "curve": {str(k): v for k, v in curve.items()},
                                   "cpu_s_per_byte": {str(k): v for k, v in cpu.items()}})
    return size


def page_size_for(size: int | None, disk_dir: str | None, device: torch.device, largest: int | None = None) -> int:
    """The page size a run uses: the one asked for (checked), else the one measured for its slowest
    link; over several ranks, rank 0's, given or measured (``parallel.agree``: every rank lays its chunks
    out alike, and ranks that measured one disk together would each have measured it disturbed).
    ``largest``: the largest page the run's chunks can take (``plan.fit.page_for_states``); below the
    smallest size measured, that is the page, and nothing is measured (a small model's first run spent
    seconds measuring sizes its chunks could never use)."""
    def local() -> int:
        if size:
            return check_page_size(size)
        if largest is not None and largest < CANDIDATES[0]:
            return largest
        return measured_page_size(disk_dir, device)
    return from_rank0("the page size", local, str, int)
