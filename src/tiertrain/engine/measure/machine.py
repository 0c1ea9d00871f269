"""A quick probe of the machine: link, disk and optimizer speeds, and the device's matmul rate.

Cached per host, device kind and disk directory in the one measurement cache, so only the first
run on a machine pays its two seconds.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tiertrain import typed
from tiertrain.engine.measure import cache
from tiertrain.engine.measure.disk import measure_disk
from tiertrain.errors import ConfigError
from tiertrain.planner.profile import MachineProfile

MiB = 1 << 20


def _rate(fn, nbytes: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def probe_machine(disk_dir: str | None = None, use_cache: bool = True) -> tuple[MachineProfile, float]:
    """(link and optimizer speeds, device matmul FLOP/s), measured in about two seconds."""
    key = f"v3:{socket.gethostname()}:{'cuda' if torch.cuda.is_available() else 'cpu'}:{disk_dir or '-'}"
    known = cache.load("machine", key) if use_cache else None
    if isinstance(known, dict):
        try:
            return typed.load(MachineProfile, known.get("machine"), "cached machine probe"), float(known["flops"])
        except (ConfigError, KeyError, TypeError, ValueError):
            pass  # damaged: measure again
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    src = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    h2d = _rate(lambda: (dst.copy_(src, non_blocking=True), sync()), src.numel())
    d2h = _rate(lambda: (src.copy_(dst, non_blocking=True), sync()), src.numel())
    read, write, disk_cpu = 1e9, 1e9, 0.0
    if disk_dir:  # as the disk tier moves pages: 1 MiB, 8 in flight, checksummed
        rates = measure_disk(Path(disk_dir), MiB, 64 * MiB, 8, verify=True)
        read, write, disk_cpu = rates.read_bps, rates.write_bps, rates.cpu_s_per_byte
    n = 4 * MiB
    p, g, m1, m2 = (torch.randn(n) for _ in range(4))
    step = [torch.zeros(())]
    from torch.optim.adamw import adamw

    adam = _rate(lambda: adamw([p], [g], [m1], [m2.abs()], [], step, fused=True, amsgrad=False, beta1=0.9,
                               beta2=0.95, lr=1e-4, weight_decay=0.0, eps=1e-8, maximize=False), n)
    a = torch.randn(1024, 1024, device=dev)
    flops = _rate(lambda: (a @ a, sync()), 2 * 1024**3)
    machine = MachineProfile(h2d, d2h, read, write, adam, device_is_host=not cuda, disk_cpu_s_per_byte=disk_cpu)
    cache.store("machine", key, {"machine": asdict(machine), "flops": flops})
    return machine, flops
