"""One line saying what machine a benchmark ran on (BENCHMARKS.md: a figure needs its machine)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tiertrain.measure.machine import cpu_model


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _disk_of(path: str) -> str:
    dev = os.stat(path).st_dev
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            major, minor = (int(x) for x in fields[2].split(":"))
            if os.makedev(major, minor) == dev:
                return f"{fields[-2]} {fields[-3]} at {fields[4]}"
    except (OSError, ValueError):
        pass
    return "unknown disk"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock around it times it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(disk_dir: str | None = None) -> str:
    parts = [f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores", f"{_ram_bytes() / 2**30:.0f} GiB RAM",
             f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        parts.append(f"{p.name} {p.total_memory / 2**30:.0f} GiB")
    else:
        parts.append("no GPU")
    if disk_dir:
        os.makedirs(disk_dir, exist_ok=True)
        parts.append(f"disk {_disk_of(disk_dir)}")
    return "; ".join(parts)
