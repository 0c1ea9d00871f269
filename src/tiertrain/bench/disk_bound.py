"""The least time a disk needs to read and write a step's bytes, from raw rates measured around the step.

A shared disk's raw rate moves by 2x within minutes on these machines (BENCHMARKS.md), so one probe
at the start of a benchmark says little about the steps timed ten minutes later. Each system's steps
are therefore bracketed by a probe before and one after, and the bound is given at both.

A probe measures three rates with the disk tier's requests (O_DIRECT pages, several in flight): reads
alone, writes alone, and half the requests reading while half write. The bound for R bytes read and
W written is the lesser of doing them one after the other and doing the common part together with the
rest alone: an SSD's separate read and write paths can make together faster than the sum, a spinning
or throttled disk slower, and the disk may do whichever is faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiertrain.measure.disk import measure_disk
from tiertrain.measure.disk_depth import together_rate

MiB = 1 << 20


@dataclass(frozen=True)
class DiskLimit:
    """Raw rates in bytes/s: reads alone, writes alone, and reads plus writes at once (their sum)."""

    read: float
    write: float
    together: float

    def seconds(self, read_bytes: float, written_bytes: float) -> float:
        """The least time these bytes take at these rates."""
        apart = read_bytes / self.read + written_bytes / self.write
        both = min(read_bytes, written_bytes)
        at_once = 2 * both / self.together + (read_bytes - both) / self.read + (written_bytes - both) / self.write
        return min(apart, at_once)

    def describe(self) -> str:
        return (f"read {self.read / 1e9:.2f} GB/s, write {self.write / 1e9:.2f} GB/s, "
                f"both at once {self.together / 1e9:.2f} GB/s")


def measure_limit(directory: Path, total: int = 1 << 30, page: int = MiB, in_flight: int = 8) -> DiskLimit:
    """Raw rates of ``total`` bytes each way in ``page`` requests, ``in_flight`` at once (a few
    seconds at 1 GiB; the file is private and removed)."""
    alone = measure_disk(directory, page, total, in_flight)
    together, _ = together_rate(directory, page, total, in_flight)
    return DiskLimit(alone.read_bps, alone.write_bps, together)
