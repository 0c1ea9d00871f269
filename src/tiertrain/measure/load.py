"""The load a measurement ran under: how much CPU other processes (and the hypervisor) took meanwhile.

A probe taken while the machine is busy reads every rate low (seen: disk 0.98 against 3.3 GB/s,
AdamW 0.30 against 0.87 G params/s, matmul 64 against 201 GFLOP/s), and a cached probe is reused
by every later run. So each probe says what else ran while it measured, and a busy one is not kept.

Others' share is the machine's busy CPU time (``/proc/stat``: user, nice, system, irq, softirq and
steal, which is the hypervisor giving our cores to someone else) less this process's own, over the
wall time. Where ``/proc/stat`` cannot be read, the 1-minute load average beyond our own threads stands in.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tiertrain.planner.machine import Load

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle 3 and iowait 4 are not busy)


def _busy_seconds() -> float | None:
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
        ticks = [int(v) for v in first[1:9]]
    except (OSError, IndexError, ValueError):
        return None
    return sum(ticks[i] for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class LoadMeter:
    """``with LoadMeter() as meter: measure()``; then ``meter.load`` says what else ran meanwhile."""

    def __init__(self) -> None:
        self.load: Load | None = None

    def __enter__(self) -> "LoadMeter":
        self._busy, self._own, self._t = _busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.perf_counter() - self._t, 1e-9)
        own = time.process_time() - self._own
        busy = _busy_seconds()
        avg = os.getloadavg()[0]
        if busy is None or self._busy is None:
            others = max(0.0, avg - own / wall)
        else:
            others = max(0.0, (busy - self._busy - own) / wall)
        self.load = Load(others_cores=round(others, 3), cores=cores(), loadavg=round(avg, 2))
