"""A tiered step's disk figures, for metrics.jsonl and the run's summary.

The bytes are the disk tier's own (counted by the memory layer: another process's traffic is not the
run's). How much of the step the disk had requests in flight comes from the kernel's counters of the
device the disk directory is on, so it counts whatever else uses that device too: near 100% says the
disk is what the step waits for (fewer bytes or a faster disk would help, more cores would not).
"""

from __future__ import annotations

import time

from tiertrain.engine.measure.diskstats import DiskCounters, disk_counters
from tiertrain.memory import MemorySystem


class DiskWatch:
    def __init__(self, mem: MemorySystem, directory: str | None) -> None:
        self.mem, self.directory = mem, directory
        self.reset()

    def reset(self) -> None:
        """From now on: what setup, a resume or a checkpoint moved is not a step's."""
        self._traffic, self._device, self._t = self._now()

    def skip_device(self) -> None:
        """The device's counters and the clock from now on (the run itself used the disk meanwhile: a
        machine probe); the tier's bytes keep counting, so a write-back that lands meanwhile is a step's."""
        _, self._device, self._t = self._now()

    def _now(self) -> tuple[dict[str, int], DiskCounters | None, float]:
        return self.mem.disk_traffic(), disk_counters(self.directory) if self.directory else None, time.perf_counter()

    def since_last(self) -> dict[str, object]:
        """``disk_bytes`` read and written since the last call (a write-back still in flight when a step
        ends counts in the step it lands in), and ``disk_busy``, the share of that time the device was
        busy, where the directory is on a block device."""
        traffic, device, t = self._now()
        row: dict[str, object] = {"disk_bytes": {k: traffic[k] - self._traffic[k] for k in traffic}}
        if device is not None and self._device is not None and t > self._t:
            row["disk_busy"] = min(1.0, (device - self._device).busy_s / (t - self._t))
        self._traffic, self._device, self._t = traffic, device, t
        return row
