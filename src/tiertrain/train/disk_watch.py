"""A tiered step's disk figures, for metrics.jsonl and the run's summary.

The bytes are the disk tier's own (counted by the memory layer: another process's traffic is not the
run's). How much of the step the disk had requests in flight comes from the kernel's counters of the
device the disk directory is on, so it counts whatever else uses that device too: near 100% says the
disk is what the step waits for (fewer bytes or a faster disk would help, more cores would not).

Each step is also split into the phases the loop marks (forward, backward, the optimizer step), with
the same figures per phase: a disk busy all through backward but idle half of forward says the next
gain is in reading during forward, which one figure per step hides. (Found by hand first, with a
trace of every request; the kernel's counters give the same answer at a few reads of a small file per
step.) Each row's ``disk_phases`` has those three and ``between`` (the rest of the row's time: writing
the row, logging); seconds are the host's (on a GPU, where the host queued the work), and ``busy`` is
left out where the directory is on no block device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tiertrain.measure.diskstats import DiskCounters, disk_counters
from tiertrain.memory import MemorySystem

FORWARD, BACKWARD, STEP = PHASES = ("forward", "backward", "step")  # what the loop marks, in a step's order
BETWEEN = "between"  # from the step's end to the next step's first mark (the row, logging, metrics)


@dataclass(frozen=True)
class _Reading:
    traffic: dict[str, int]
    device: DiskCounters | None
    t: float


class DiskWatch:
    def __init__(self, mem: MemorySystem, directory: str | None) -> None:
        self.mem, self.directory = mem, directory
        self.reset()

    def reset(self) -> None:
        """From now on: what setup, a resume or a checkpoint moved is not a step's (between steps: the
        step's phases start again at ``between``)."""
        self._start = self._mark = self._now()
        self._phase = BETWEEN
        self._phases: dict[str, dict[str, float]] = {}

    def skip_device(self) -> None:
        """The device's counters and the clock from now on (the run itself used the disk meanwhile: a
        machine probe); the tier's bytes keep counting, so a write-back that lands meanwhile is a step's."""
        now = self._now()
        self._start = _Reading(self._start.traffic, now.device, now.t)
        self._mark = _Reading(self._mark.traffic, now.device, now.t)

    def _now(self) -> _Reading:
        return _Reading(self.mem.disk_traffic(), disk_counters(self.directory) if self.directory else None,
                        time.perf_counter())

    def mark(self, phase: str) -> None:
        """The step enters ``phase`` now: what the disk did since the last mark is the last phase's."""
        now = self._now()
        into = self._phases.setdefault(self._phase, {"s": 0.0, "busy_s": 0.0, "read": 0, "written": 0})
        into["s"] += now.t - self._mark.t
        into["read"] += now.traffic["read"] - self._mark.traffic["read"]
        into["written"] += now.traffic["written"] - self._mark.traffic["written"]
        if now.device is not None and self._mark.device is not None:
            into["busy_s"] += (now.device - self._mark.device).busy_s
        self._mark, self._phase = now, phase

    def since_last(self) -> dict[str, object]:
        """``disk_bytes`` read and written since the last call (a write-back still in flight when a step
        ends counts in the step it lands in), and ``disk_busy``, the share of that time the device was
        busy, where the directory is on a block device; ``disk_phases``, the same per phase marked."""
        self.mark(BETWEEN)
        now, start = self._mark, self._start
        row: dict[str, object] = {"disk_bytes": {k: now.traffic[k] - start.traffic[k] for k in now.traffic}}
        busy = now.device is not None and start.device is not None
        if busy and now.t > start.t:
            row["disk_busy"] = min(1.0, (now.device - start.device).busy_s / (now.t - start.t))
        row["disk_phases"] = {name: _phase_row(p, busy) for name, p in self._phases.items()}
        self._start, self._phases = now, {}
        return row


def _phase_row(p: dict[str, float], busy: bool) -> dict[str, float]:
    out = {"s": p["s"], "read": int(p["read"]), "written": int(p["written"])}
    if busy:
        out["busy"] = min(1.0, p["busy_s"] / p["s"]) if p["s"] > 0 else 0.0
    return out
