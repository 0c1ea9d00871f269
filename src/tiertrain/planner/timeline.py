"""The simulator's resources: one lane each, on which a task holds the resource for its seconds.

A task starts at the first gap of its lane, at or after it is ready, long enough to hold it. The
simulator schedules work block by block rather than in time order (a block's update is placed before
the next block's fetch, though that fetch was submitted earlier): filling gaps lets a task scheduled
later but ready earlier run in the idle time before the tasks placed already, where appending after
the lane's last task would queue an early read behind a later one. It is not a queue: a task that
does not fit a gap goes after the tasks around it, even one that became ready after it.
A disk's reads and writes take turns on one lane, as the step's disk bound adds them up (``simulator``),
unless the disk tier lets them go at once (``shared_disk`` False: a lane each, ``MachineProfile.disk_lanes``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

RESOURCES = ("compute", "h2d", "d2h", "disk_read", "disk_write", "cpu", "net")


@dataclass
class Timeline:
    shared_disk: bool = True  # reads and writes on one lane
    tasks: list[tuple[str, float, float, str]] = field(default_factory=list)   # resource, start, end, label
    _starts: dict[str, list[float]] = field(default_factory=dict)
    _ends: dict[str, list[float]] = field(default_factory=dict)

    def run(self, resource: str, ready: float, seconds: float, label: str) -> tuple[float, float]:
        """Hold ``resource`` for ``seconds`` in the first gap from ``ready`` on: (start, end)."""
        if resource not in RESOURCES:
            raise KeyError(resource)
        lane = "disk" if self.shared_disk and resource.startswith("disk") else resource
        starts, ends = self._starts.setdefault(lane, []), self._ends.setdefault(lane, [])
        start = ready
        k = bisect.bisect_right(ends, start)       # the first busy span that ends after ``ready``
        while k < len(starts) and starts[k] < start + seconds:
            start = max(start, ends[k])           # it overlaps: try the gap after it
            k += 1
        end = start + seconds
        if seconds > 0:
            starts.insert(k, start)
            ends.insert(k, end)
            self.tasks.append((resource, start, end, label))
        return start, end

    def busy(self, resource: str) -> float:
        return sum(e - s for r, s, e, _ in self.tasks if r == resource)
