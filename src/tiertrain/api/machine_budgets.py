"""Budgets taken from the machine where the user gives none.

Device: 90% of the GPU's free memory (``torch.cuda.mem_get_info``: what other processes hold is not
ours; the rest is the CUDA allocator's slack); without a GPU the device tier is host memory under
its own budget, and takes at most 4 GiB, a quarter of what is available. Host: at most half the
RAM, and 90% of what the process may still take now (``MemAvailable``, under its memory cgroup's
limit), beside the device tier on a CPU-only machine: the rest is for activations, the model
object and the libraries. No disk unless one is given: a disk directory is the user's choice.

Over several ranks, what is taken is agreed (``parallel.agree``): the ranks of one host divide its
memory (each of them sees all of it free at start, and taking that each would ask for it several
times over), and every rank takes the least any rank can, so that all of them plan alike.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

from tiertrain.memory import Budgets
from tiertrain.memory.capacity import cgroup_room, host_available
from tiertrain.parallel.agree import every_rank
from tiertrain.plan.fit import weights_beyond
from tiertrain.units import format_bytes

DEVICE_SHARE = 0.9
CPU_DEVICE_CAP = 4 << 30
HOST_SHARE = 0.9


@dataclass(frozen=True)
class TakenBudgets:
    budgets: Budgets
    taken: tuple[str, ...]   # which tiers came from the machine (the others were given)

    def describe(self) -> str:
        b = self.budgets
        parts = [f"device {format_bytes(b.device)}", f"host {format_bytes(b.host)}",
                 f"disk {format_bytes(b.disk)} in {b.disk_dir}" if b.disk else "no disk"]
        return f"budgets: {', '.join(parts)} ({', '.join(self.taken)} taken from the machine)"


def machine_budgets(device: torch.device, given_device: int | None = None, given_host: int | None = None,
                    disk: int = 0, disk_dir: str | None = None) -> TakenBudgets:
    """The budgets a run gets: those given, the others from this machine as the module says."""
    taken = []
    dev = given_device
    if dev is None:
        taken.append("device")
        if device.type == "cuda":
            dev = int(torch.cuda.mem_get_info(device)[0] * DEVICE_SHARE)
        else:
            dev = min(CPU_DEVICE_CAP, host_available() // 4)
    host = given_host
    if host is None:
        taken.append("host")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        room = host_available() - (dev if device.type == "cpu" else 0)
        host = max(0, min(ram // 2, int(HOST_SHARE * room)))
    dev, host = _agreed(dev, host, *shared_tiers(taken, device))
    return TakenBudgets(Budgets(dev, host, disk, disk_dir), tuple(taken))


def shared_tiers(taken: "list[str] | tuple[str, ...]", device: torch.device) -> tuple[bool, bool]:
    """Whether the device and the host budget taken from the machine are shared by its ranks (the host's
    memory is; a GPU's is its rank's own; a given budget is already each rank's)."""
    return "device" in taken and device.type == "cpu", "host" in taken


def _agreed(dev: int, host: int, divide_dev: bool, divide_host: bool) -> tuple[int, int]:
    """The budgets every rank takes: what each took of its host's memory divided among that host's
    ranks (a GPU's is its rank's own; a given budget is already each rank's), the least over the
    ranks. One process: its own."""
    every = every_rank("the budgets", (dev, host, divide_dev, divide_host))
    if len(every) == 1:
        return dev, host
    ranks_on = Counter(name for name, _ in every)
    shares = [(d // (ranks_on[name] if split_d else 1), h // (ranks_on[name] if split_h else 1))
              for name, (d, h, split_d, split_h) in every]
    return min(d for d, _ in shares), min(h for _, h in shares)


def meta_build_reason(weights: int, budgets: Budgets, device: torch.device) -> str | None:
    """Why a model of ``weights`` fp32 bytes must be built on the meta device for a tiered run (setup
    then draws it block by block), or None where it may be built in memory (``plan.fit.weights_beyond``)."""
    return weights_beyond(weights, budgets, device.type == "cpu", cgroup_room())
