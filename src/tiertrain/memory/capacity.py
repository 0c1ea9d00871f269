"""What this machine can actually give each tier, checked before any pool is reserved.

A budget is a promise the pools keep; one the machine cannot keep would end in an mmap error,
the kernel's OOM killer or a full disk mid-run. So budgets are held against the memory available
now (``MemAvailable``, and the memory cgroup's limit less its usage where one applies), the
device's free memory, and the disk's free space, and refused with one line naming the real figure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tiertrain.errors import UserError
from tiertrain.plan.budgets import Budgets
from tiertrain.units import format_bytes

_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


class BeyondMachine(UserError):
    """A budget larger than what the machine has."""


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_dirs() -> list[Path]:
    """The memory cgroup directories this process is in (v1 memory controller, or v2 unified)."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            out.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return _UNLIMITED if text == "max" else int(text) if text.isdigit() else None


def _cache_bytes(group: Path) -> int:
    """Page cache a cgroup counts but can reclaim (v1 ``cache``, v2 ``file``)."""
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("cache", "file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (its limit, less what it uses beyond
    reclaimable page cache); None where no limit applies."""
    rooms = []
    for group in _cgroup_dirs():
        limit = _read_int(group / "memory.limit_in_bytes") or _read_int(group / "memory.max")
        usage = _read_int(group / "memory.usage_in_bytes") or _read_int(group / "memory.current")
        if limit is None or limit >= _UNLIMITED or usage is None:
            continue
        rooms.append(max(0, limit - max(0, usage - _cache_bytes(group))))
    return min(rooms) if rooms else None


def host_available() -> int:
    """Host memory this process may still take: the smaller of what the kernel calls available
    and what its memory cgroup allows."""
    room = cgroup_room()
    free = _meminfo_available()
    return free if room is None else min(free, room)


def check_budgets(budgets: Budgets, device: torch.device) -> None:
    """Refuse budgets the machine cannot hold, before anything is reserved. Without a GPU the
    device tier is host memory too, so device and host budgets share the host's room."""
    host_need = budgets.host + (budgets.device if device.type == "cpu" else 0)
    have = host_available()
    if host_need > have:
        what = "device + host budgets" if device.type == "cpu" else "host budget"
        raise BeyondMachine(f"the {what} ({format_bytes(host_need)}) exceed the memory this process can take "
                            f"({format_bytes(have)} available now{_cgroup_note()}); lower --host-memory"
                            + (" / --device-memory" if device.type == "cpu" else ""))
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if budgets.device > free:
            raise BeyondMachine(f"the device budget ({format_bytes(budgets.device)}) exceeds the free memory of "
                                f"{torch.cuda.get_device_name(device)} ({format_bytes(free)}); lower --device-memory")
    if budgets.disk and budgets.disk_dir:
        check_disk_room(budgets.disk, Path(budgets.disk_dir))


def check_disk_room(nbytes: int, directory: Path) -> None:
    """The disk budget against the free space of the filesystem that will hold it."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the directory is created later; its filesystem is its nearest parent's
    free = shutil.disk_usage(probe).free
    if nbytes > free:
        raise BeyondMachine(f"the disk budget ({format_bytes(nbytes)}) exceeds the free space under {directory} "
                            f"({format_bytes(free)}); lower the size in --disk DIR:SIZE or free space there")


def _cgroup_note() -> str:
    room = cgroup_room()
    return f", {format_bytes(room)} under this process's memory cgroup limit" if room is not None else ""
