"""What this machine can actually give each tier, measured before any pool is reserved: the memory
available now (``MemAvailable``, and the memory cgroup's limit less its usage where one applies), the
device's free memory, and the disk's free space. Whether the budgets fit in it is ``plan.fit``'s
decision (``check_machine``), which refuses with one line naming the real figure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tiertrain.plan.budgets import Budgets
from tiertrain.plan.fit import MachineRoom, check_machine
from tiertrain.units import format_bytes

_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


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


def machine_room(budgets: Budgets, device: torch.device, freed: int = 0) -> MachineRoom:
    """What this machine can give the tiers now: the host memory this process may take, an accelerator's
    free memory, the disk directory's free space. ``freed``: host bytes setup frees as it builds."""
    disk_free = None
    if budgets.disk and budgets.disk_dir:
        probe = Path(budgets.disk_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent  # the directory is created later; its filesystem is its nearest parent's
        disk_free = shutil.disk_usage(probe).free
    if device.type != "cuda":
        return MachineRoom(host_available(), freed, True, disk_free=disk_free, note=_cgroup_note())
    free, _total = torch.cuda.mem_get_info(device)
    return MachineRoom(host_available(), freed, False, free, torch.cuda.get_device_name(device), disk_free,
                       _cgroup_note())


def check_budgets(budgets: Budgets, device: torch.device, freed: int = 0) -> None:
    """Refuse budgets the machine cannot hold, before anything is reserved (``plan.fit.check_machine``)."""
    check_machine(budgets, machine_room(budgets, device, freed))


def _cgroup_note() -> str:
    room = cgroup_room()
    return f", {format_bytes(room)} under this process's memory cgroup limit" if room is not None else ""
