"""A step's CPU figures, for metrics.jsonl and the run's summary.

A step slower than its compute either runs out of cores (backward sharing them with the CPU
optimizer, checksums and copies) or waits (for the disk, a slot, a collective). The process's CPU
seconds over the wall seconds, per step and per phase the loop marks, say which: near the cores this
process may use, less CPU work (fewer copies, fewer bytes checksummed) would help and a faster disk
would not; well below them, the step waits, and ``disk_watch``'s figures say whether for the disk.
The kernel's share is the time in system calls and page faults (on a CPU, memory the allocator gave
back and maps again is zeroed by the kernel each step).

Found by hand first: the 354M disk plan at 2 GiB of host used 1.2 of 2 cores, forward and backward
waiting on the disk, where a profile of its threads had suggested it was short of cores.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Callable

from tiertrain.train.disk_watch import BETWEEN


@dataclass(frozen=True)
class CpuTimes:
    user: float    # seconds, all the process's threads
    kernel: float
    t: float       # the wall clock

    @property
    def cpu(self) -> float:
        return self.user + self.kernel


def process_times() -> CpuTimes:
    """Microsecond resolution (``os.times`` counts clock ticks: 10 ms, as long as a small model's phase)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return CpuTimes(r.ru_utime, r.ru_stime, time.perf_counter())


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or ``taskset``'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuWatch:
    def __init__(self, read: Callable[[], CpuTimes] = process_times) -> None:
        self._read = read
        self.reset()

    def reset(self) -> None:
        """From now on: what a checkpoint or a machine probe took is no step's."""
        self._start = self._mark = self._read()
        self._phase = BETWEEN
        self._phases: dict[str, list[float]] = {}  # phase -> [wall s, cpu s]

    def mark(self, phase: str) -> None:
        """The step enters ``phase`` now: the CPU used since the last mark is the last phase's."""
        now = self._read()
        into = self._phases.setdefault(self._phase, [0.0, 0.0])
        into[0] += now.t - self._mark.t
        into[1] += now.cpu - self._mark.cpu
        self._mark, self._phase = now, phase

    def since_last(self) -> dict[str, object]:
        """``cpu``: the cores busy on average since the last call (CPU seconds over wall seconds), the
        kernel's share of that CPU, and the cores busy in each phase marked and its wall seconds (where a
        step slower than predicted spends its time: on a GPU, an optimizer step of 5 s beside a forward
        of 1 s says the host, not the device)."""
        self.mark(BETWEEN)
        now, start = self._mark, self._start
        used, wall = now.cpu - start.cpu, now.t - start.t
        row = {"cores": used / wall if wall > 0 else 0.0,
               "kernel": (now.kernel - start.kernel) / used if used > 0 else 0.0,
               "phases": {name: cpu / s if s > 0 else 0.0 for name, (s, cpu) in self._phases.items()},
               "phase_s": {name: s for name, (s, _) in self._phases.items()}}
        self._start, self._phases = now, {}
        return {"cpu": row}
