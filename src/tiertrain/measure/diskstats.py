"""What a block device has done, from the kernel's own counters (``/proc/diskstats``): bytes read and
written whoever moved them, and the time it had requests in flight. A benchmark sets a step's bytes
against the disk's rates with them; a run reports how much of each step its disk was busy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskCounters:
    """What the block device has done so far (or between two readings, subtracted): bytes read and
    written, and seconds with at least one request in flight (a step whose disk is busy all its time
    cannot go faster without fewer bytes or a faster disk, whatever a probe says)."""

    read: int
    written: int
    busy_s: float

    def __sub__(self, other: DiskCounters) -> DiskCounters:
        return DiskCounters(self.read - other.read, self.written - other.written, self.busy_s - other.busy_s)


def disk_counters(directory: str) -> DiskCounters | None:
    """The counters of the block device ``directory`` is on (``/proc/diskstats`` counts 512-byte sectors,
    whatever the device's own sector size, and busy time in ms); None where it is on none (a tmpfs, an
    overlay)."""
    try:
        dev = os.stat(directory).st_dev
        with open("/proc/diskstats", encoding="ascii") as stats:
            lines = stats.read().splitlines()
    except OSError:  # no /proc/diskstats (not Linux, a locked-down container), or the directory is gone
        return None
    for line in lines:
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return DiskCounters(int(f[5]) * 512, int(f[9]) * 512, int(f[12]) / 1000)
    return None
