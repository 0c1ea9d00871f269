"""Benchmark of the memory layer against the raw hardware, measured in the same run.

Raw disk: sequential O_DIRECT writes then reads of a file as large as the traffic, in
blocks of the page size, once with one request in flight (what ``dd oflag=direct``
does) and once with ``io_workers`` in flight (what ``fio --iodepth`` does); the limit is
the better of the two. Tier: chunks moved host->disk then disk->host through the
MemorySystem, all moves issued before any is waited for. Repeats alternate raw and tier.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tiertrain.memory import Budgets, MemorySystem, Tier
from tiertrain.measure.disk import measure_disk
from tiertrain.measure.page_size import measured_page_size
from tiertrain.memory.pool import host_buffer

MiB = 1 << 20


@dataclass
class Figure:
    write: float  # bytes/s
    read: float


def _drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass  # not root: O_DIRECT bypasses the cache anyway


def raw_disk(directory: Path, total: int, block: int, in_flight: int) -> Figure:
    rates = measure_disk(directory, block, total, in_flight)
    return Figure(rates.write_bps, rates.read_bps)


def tier_disk(directory: Path, total: int, page: int, chunk: int, io_workers: int) -> Figure:
    budget = total + page * (total // chunk + 1)
    with MemorySystem(Budgets(device=page, host=budget, disk=budget, disk_dir=str(directory)),
                      page_size=page, io_workers=io_workers) as mem:
        chunks = [mem.allocate(f"c{i}", chunk, Tier.HOST) for i in range(total // chunk)]
        for c in chunks:
            for v in c.views():
                v.random_(0, 256)
        t = time.perf_counter()
        for h in [mem.move(c, Tier.DISK) for c in chunks]:
            h.wait()
        os.fsync(mem.pool(Tier.DISK).fd)
        write = total / (time.perf_counter() - t)
        _drop_caches()
        t = time.perf_counter()
        for h in [mem.move(c, Tier.HOST) for c in chunks]:
            h.wait()
        read = total / (time.perf_counter() - t)
    return Figure(write, read)


def _median(runs: list[Figure]) -> tuple[Figure, Figure, Figure]:
    w = sorted(r.write for r in runs)
    r = sorted(r.read for r in runs)
    return Figure(statistics.median(w), statistics.median(r)), Figure(w[0], r[0]), Figure(w[-1], r[-1])


def run_memory_bench(disk_dir: str | None, total: int, page_sizes: list[int], chunk: int, repeats: int,
                     io_workers: int, out: Callable[[str], None]) -> dict:
    from tiertrain.bench.machine import describe

    directory = Path(disk_dir or tempfile.mkdtemp(prefix="tiertrain-bench-", dir="."))
    directory.mkdir(parents=True, exist_ok=True)
    out(f"machine: {describe(str(directory))}")
    picked = measured_page_size(str(directory), torch.device("cpu"))
    out(f"page size picked for this disk (smallest reaching 95% of the plateau, cached): {picked // 1024} KiB")
    sizes = sorted(set(page_sizes) | {picked})
    results = {"page_size_picked": picked, "rows": []}
    gb = 1e9
    out(f"{'page':>8} {'raw wr (dd)':>12} {'raw wr (qd)':>12} {'tier wr':>9} {'ratio':>6}   "
        f"{'raw rd (dd)':>12} {'raw rd (qd)':>12} {'tier rd':>9} {'ratio':>6}   GB/s, median of {repeats}")
    for page in sizes:
        dd, qd, tier = [], [], []
        for _ in range(repeats):  # alternate the limit and the tier
            dd.append(raw_disk(directory, total, page, 1))
            qd.append(raw_disk(directory, total, page, io_workers))
            tier.append(tier_disk(directory, total, page, chunk, io_workers))
        (dd_m, _, _), (qd_m, _, _), (t_m, t_min, t_max) = _median(dd), _median(qd), _median(tier)
        limit = Figure(max(dd_m.write, qd_m.write), max(dd_m.read, qd_m.read))
        row = {"page": page, "raw_dd": vars(dd_m), "raw_qd": vars(qd_m), "tier": vars(t_m),
               "tier_min": vars(t_min), "tier_max": vars(t_max),
               "write_ratio": t_m.write / limit.write, "read_ratio": t_m.read / limit.read}
        results["rows"].append(row)
        out(f"{page // 1024:>6}Ki {dd_m.write / gb:>12.2f} {qd_m.write / gb:>12.2f} {t_m.write / gb:>9.2f} "
            f"{row['write_ratio']:>6.2f}   {dd_m.read / gb:>12.2f} {qd_m.read / gb:>12.2f} {t_m.read / gb:>9.2f} "
            f"{row['read_ratio']:>6.2f}")
    best = next(r for r in results["rows"] if r["page"] == picked)
    out(f"disk tier at the picked page size: write {best['write_ratio']:.2f}, read {best['read_ratio']:.2f} "
        f"of the raw disk (target >= 0.85)")
    if torch.cuda.is_available():
        results["h2d"] = _pcie(total, picked, repeats, out)
    else:
        out("host<->device: no GPU on this machine; the device tier is CPU memory here (see the memcpy curve)")
    if disk_dir is None:
        directory.rmdir()
    return results


def _pcie(total: int, page: int, repeats: int, out: Callable[[str], None]) -> dict:
    """Pinned host<->device: raw one-shot copy vs chunks moved through the pools."""
    raw, tier = [], []
    src, _r = host_buffer(total, pin=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        raw.append(total / (time.perf_counter() - t))
        with MemorySystem(Budgets(device=total + 2 * page, host=total + 2 * page), page_size=page) as mem:
            chunks = [mem.allocate(f"c{i}", 64 * MiB, Tier.HOST) for i in range(total // (64 * MiB))]
            t = time.perf_counter()
            for h in [mem.move(c, Tier.DEVICE) for c in chunks]:
                h.wait()
            tier.append(len(chunks) * 64 * MiB / (time.perf_counter() - t))
    r, m = statistics.median(raw), statistics.median(tier)
    out(f"host->device pinned: raw {r / 1e9:.2f} GB/s, tier {m / 1e9:.2f} GB/s, ratio {m / r:.2f} (target >= 0.85)")
    return {"raw": r, "tier": m, "ratio": m / r}
