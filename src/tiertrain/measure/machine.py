"""This machine's description, measured (``tiertrain probe``): link, disk, optimizer, memory and
matmul speeds, and its memory sizes, in a few seconds.

Kept per host, device kind and disk directory in the one measurement cache, so only the first run
on a machine pays; but only a probe taken on a quiet machine is kept (``load``): a busy one reads
every rate low and would mislead every later plan. A cached probe that a run's steps prove wrong is
dropped and measured again (``engine.auto_plan.AutoPlan.recheck``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import shutil
import socket
import statistics
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

from tiertrain import typed
from tiertrain.measure import cache
from tiertrain.measure.disk import measure_disk
from tiertrain.measure.load import LoadMeter
from tiertrain.errors import ConfigError
from tiertrain.memory.heap import release_free_heap
from tiertrain.planner.machine import Machine, PerDtype
from tiertrain.planner.profile import MachineProfile
from tiertrain.precisions import PRECISIONS, torch_dtype

MiB = 1 << 20
T = TypeVar("T")
log = logging.getLogger("tiertrain")


def _rate(fn: Callable[[], object], amount: float, repeat: int = 3) -> float:
    """``amount`` (bytes, FLOPs) over the best of ``repeat`` timed calls, after one untimed."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return amount / best


def probe_key(disk_dir: str | None) -> str:
    """Which cached probe a run may reuse: same host, device kind and disk directory."""
    return f"v5:{socket.gethostname()}:{'cuda' if torch.cuda.is_available() else 'cpu'}:{disk_dir or '-'}"


PROBE_SCRATCH = 512 * MiB  # the most a probe allocates at once (its AdamW's states): beyond any cache
RUN_SCRATCH = 64 * MiB     # the least a run's own probe may allocate: within the overhead a run is allowed


def run_scratch(host_side_budgets: int) -> int:
    """What a run's probe may allocate at once: no more than the budgets the run holds in host memory
    (at least ``RUN_SCRATCH``), up to a whole probe's. A small model's first ``plan auto`` probed with a
    whole probe's 512 MiB of AdamW states and peaked at 1.1 GiB of RSS beside 80 MiB of budgets."""
    return max(RUN_SCRATCH, min(PROBE_SCRATCH, host_side_budgets))


def probe(disk_dir: str | None = None, use_cache: bool = True, scratch: int = PROBE_SCRATCH) -> Machine:
    """This machine's description, from the cache or measured (and kept if the machine was quiet).
    ``scratch``: the most its measurements allocate at once; a probe with less (inside a run that
    holds its budgets, which the user sized to the machine) is used once and not kept, as a busy one."""
    key = probe_key(disk_dir)
    known = cache.load("machine", key) if use_cache else None
    if known is not None:
        try:
            return typed.load(Machine, known, "cached machine probe")
        except ConfigError:
            pass  # damaged, or from another version: measure again
    with LoadMeter() as meter:
        machine = _measure(disk_dir, scratch)
    machine = dataclasses.replace(machine, load=meter.load)
    if meter.load.busy:
        log.warning("the machine was busy while it was probed (others used %.1f of %d cores): its figures are "
                    "used once and not cached", meter.load.others_cores, meter.load.cores)
    elif scratch >= PROBE_SCRATCH:
        cache.store("machine", key, dataclasses.asdict(machine))
    return machine


def with_disk_gain(machine: Machine, disk_dir: str | None) -> Machine:
    """``machine`` with how much faster its disk moves reads and writes at once than in turns, at its
    page size (``engine.measure.disk_depth``: 12-20 s once per disk and page size, then cached), as
    ``tiertrain probe`` describes it and ``tiertrain plan`` plans with it. Not part of ``probe``: an
    auto plan measures the gain at its run's own page size, once."""
    if not disk_dir or not machine.page_size:
        return machine
    from tiertrain.measure.disk_depth import together_gain

    return dataclasses.replace(machine, disk_together_gain=together_gain(disk_dir, machine.page_size))


def forget(disk_dir: str | None) -> None:
    """Drop this machine's cached probe, so the next run measures it again."""
    cache.forget("machine", probe_key(disk_dir))


def probe_machine(disk_dir: str | None = None, use_cache: bool = True) -> tuple[MachineProfile, float]:
    """(the simulator's rates, fp32 matmul FLOP/s) of ``probe``, as the benchmarks read them."""
    machine = probe(disk_dir, use_cache)
    return machine.rates(), machine.matmul_flops.fp32


def _measure(disk_dir: str | None, scratch: int) -> Machine:
    """A whole probe measures this machine's page size too (what ``tiertrain plan`` takes for it); one
    sized to a run takes the cached one, or none (the run measured or named its own). Each measurement's
    freed buffers go back to the OS before the next (``memory.heap``): glibc kept a matrix product's, and
    the next measurement's peak stood on top of them."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    h2d, d2h = _trimmed(lambda: _copies(dev, sync, min(64 * MiB, scratch // 2)))
    read, write, disk_cpu = _disk_rates(Path(disk_dir)) if disk_dir else (1e9, 1e9, 0.0)
    from tiertrain.measure.page_size import known_page_size, measured_page_size

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Machine(name=_name(dev), device=dev.type,
                   device_memory=torch.cuda.get_device_properties(dev).total_memory if cuda else ram,
                   host_memory=ram, peak_flops=PerDtype(0.0, 0.0, 0.0), matmul_flops=_trimmed(lambda: _matmuls(dev, sync)),
                   memory_bps=_trimmed(lambda: _memory_bps(dev, sync, min(32 * MiB, scratch // 12))), h2d_bps=h2d,
                   d2h_bps=d2h, disk_read_bps=read, disk_write_bps=write,
                   adam_params_per_s=_trimmed(lambda: _adam(scratch // 16)), disk_cpu_s_per_byte=disk_cpu,
                   disk_bytes=shutil.disk_usage(disk_dir).free if disk_dir else 0,
                   page_size=measured_page_size(disk_dir, dev) if scratch >= PROBE_SCRATCH else
                   known_page_size(disk_dir, dev) or 0,
                   source=f"measured by tiertrain probe on {time.strftime('%Y-%m-%d %H:%M')}")


def _trimmed(measure: Callable[[], T]) -> T:
    """A measurement, its freed buffers given back to the OS afterwards."""
    try:
        return measure()
    finally:
        release_free_heap()


DISK_ROUNDS = 5


def _disk_rates(directory: Path) -> tuple[float, float, float]:
    """(read, write bytes/s, CPU s per byte) as the disk tier moves pages (1 MiB, 8 in flight,
    checksummed): each the median of ``DISK_ROUNDS`` short measurements (a second or two in all). One
    64 MiB measurement is over in tens of ms, so one blip of a shared disk decided the rate cached and
    planned for by every later run; the median of five smooths such blips (not a dip of minutes: a
    recheck finds that from the steps), and the best would promise a rate the disk seldom gives."""
    rounds = [measure_disk(directory, MiB, 64 * MiB, 8, verify=True) for _ in range(DISK_ROUNDS)]
    return (statistics.median(r.read_bps for r in rounds), statistics.median(r.write_bps for r in rounds),
            statistics.median(r.cpu_s_per_byte for r in rounds))


def _name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{socket.gethostname()} ({torch.cuda.get_device_name(dev)})"
    return f"{socket.gethostname()} ({cpu_model()}, {len(os.sched_getaffinity(0))} cores)"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere the platform's word for it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _copies(dev: torch.device, sync: Callable[[], None], nbytes: int) -> tuple[float, float]:
    cuda = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = _rate(lambda: (dst.copy_(src, non_blocking=True), sync()), src.numel())
    d2h = _rate(lambda: (src.copy_(dst, non_blocking=True), sync()), src.numel())
    return h2d, d2h


def _adam(n: int) -> float:
    """Fused AdamW over ``n`` parameters (32 M in a probe: 512 MiB of states and gradients, beyond any
    cache, as a block's are; 4 M, the earlier probe's, fit in this machine's L3 and read 3.3 G params/s,
    1.7 here; 16 M read as 32 M on a 32 MiB L3, 8 M 8% faster)."""
    from torch.optim.adamw import adamw

    p, g, m1, m2 = (torch.randn(n) for _ in range(4))
    m2 = m2.abs()
    step = [torch.zeros(())]
    return _rate(lambda: adamw([p], [g], [m1], [m2], [], step, fused=True, amsgrad=False, beta1=0.9, beta2=0.95,
                               lr=1e-4, weight_decay=0.0, eps=1e-8, maximize=False), n)


MATMUL_CALL_S = 0.05  # a product this long is past the kernel's start-up: large enough to time


def _matmuls(dev: torch.device, sync: Callable[[], None]) -> PerDtype:
    """Achieved FLOP/s of a square matrix product per precision (up to 2048 on CPU, 4096 on a GPU).
    Each size grows from 256 only while one product takes under ``MATMUL_CALL_S``: a CPU without fp16
    kernels multiplied 2048-square fp16 matrices at 0.3 GFLOP/s, 57 s a product, and the probe took
    four minutes timing a precision no CPU run computes in."""
    top = 4096 if dev.type == "cuda" else 2048
    rates = []
    for name in PRECISIONS:
        n = 256
        while True:
            a = torch.randn(n, n, device=dev).to(torch_dtype(name))
            a @ a  # untimed: a GPU's first product loads its kernels (and cuBLAS), which takes longer than one
            sync()
            t = time.perf_counter()
            a @ a
            sync()
            if n >= top or time.perf_counter() - t >= MATMUL_CALL_S:
                break
            n *= 2
        rates.append(_rate(lambda a=a: (a @ a, sync()), 2 * n**3))
    return PerDtype(*rates)


def _memory_bps(dev: torch.device, sync: Callable[[], None], n: int) -> float:
    """Bytes read and written per second by an element-wise op (an add of ``n``-element tensors: 128 MiB
    in a probe), as the norms, activations and residuals of a block move theirs (384 MiB: beyond the caches)."""
    a, b, c = (torch.ones(n, device=dev) for _ in range(3))
    return _rate(lambda: (torch.add(a, b, out=c), sync()), 3 * a.numel() * 4)
