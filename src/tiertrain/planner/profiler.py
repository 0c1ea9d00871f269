"""Where profiles come from: a quick probe of the machine, and per-block figures.

Per-block figures are either measured on the real model (``engine.profiling``: warm-up
steps with timing hooks and a saved-tensor counter; it runs the model, so it lives in the
engine) or derived from the config here (``analytic_blocks``: FLOPs at the probed matmul
rate, and ANGEL-PTM Table 1's activation sizes, for models too big to run here). Machine probes
are cached per host name in the tiertrain cache directory.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from tiertrain.memory.disk import checksum
from tiertrain.memory.page_size import cache_dir
from tiertrain.memory.pool import host_buffer
from tiertrain.models.accounting import PRECISION_BYTES, block_params, embedding_params
from tiertrain.models.config import ModelConfig
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile

MiB = 1 << 20


def _rate(fn, nbytes: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _disk_rates(directory: Path, nbytes: int = 64 * MiB, block: int = MiB, in_flight: int = 8) -> tuple[float, float, float]:
    """(read bytes/s, write bytes/s, CPU seconds per byte moved), measured the way the disk tier
    moves pages: O_DIRECT, one page per request, ``in_flight`` requests at once, each page
    checksummed. The CPU figure is what a CPU-only machine loses from its compute to disk I/O."""
    directory.mkdir(parents=True, exist_ok=True)
    bufs = [host_buffer(block, pin=False) for _ in range(in_flight)]  # (tensor, its mapping): keep both
    views = [memoryview(b.random_(0, 256).numpy()) for b, _ in bufs]
    n = nbytes // block
    fd, path = tempfile.mkstemp(dir=directory, prefix=".tiertrain-probe-")
    os.close(fd)
    fd = -1

    def write(i: int) -> None:
        checksum(views[i % in_flight])
        os.pwrite(fd, views[i % in_flight], i * block)

    def read(i: int) -> None:
        os.preadv(fd, [views[i % in_flight]], i * block)
        checksum(views[i % in_flight])

    try:
        fd = _open_direct(path)
        with ThreadPoolExecutor(in_flight) as pool:
            cpu, t = time.process_time(), time.perf_counter()
            list(pool.map(write, range(n)))
            os.fsync(fd)
            write_bps = n * block / (time.perf_counter() - t)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            list(pool.map(read, range(n)))
            read_bps = n * block / (time.perf_counter() - t)
            cpu_per_byte = (time.process_time() - cpu) / (2 * n * block)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)
    return read_bps, write_bps, cpu_per_byte


def _open_direct(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:  # no O_DIRECT on this filesystem: the tier falls back to buffered I/O, as here
        return os.open(path, os.O_RDWR)


def probe_machine(disk_dir: str | None = None, use_cache: bool = True) -> tuple[MachineProfile, float]:
    """(link and optimizer speeds, device matmul FLOP/s), measured in about two seconds."""
    key = f"v2:{socket.gethostname()}:{'cuda' if torch.cuda.is_available() else 'cpu'}:{disk_dir or '-'}"
    cache = cache_dir() / "machine_profile.json"
    try:
        known = json.loads(cache.read_text()) if use_cache else {}
    except (OSError, ValueError):  # none yet, or a damaged one: measure again
        known = {}
    if key in known:
        d = known[key]
        return MachineProfile(**d["machine"]), d["flops"]
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    src = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    h2d = _rate(lambda: (dst.copy_(src, non_blocking=True), sync()), src.numel())
    d2h = _rate(lambda: (src.copy_(dst, non_blocking=True), sync()), src.numel())
    read, write, disk_cpu = _disk_rates(Path(disk_dir)) if disk_dir else (1e9, 1e9, 0.0)
    n = 4 * MiB
    p, g, m1, m2 = (torch.randn(n) for _ in range(4))
    step = [torch.zeros(())]
    from torch.optim.adamw import adamw

    adam = _rate(lambda: adamw([p], [g], [m1], [m2.abs()], [], step, fused=True, amsgrad=False, beta1=0.9,
                               beta2=0.95, lr=1e-4, weight_decay=0.0, eps=1e-8, maximize=False), n)
    a = torch.randn(1024, 1024, device=dev)
    flops = _rate(lambda: (a @ a, sync()), 2 * 1024**3)
    machine = MachineProfile(h2d, d2h, read, write, adam, device_is_host=not cuda, disk_cpu_s_per_byte=disk_cpu)
    known[key] = {"machine": asdict(machine), "flops": flops}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(cache)
    return machine, flops


def analytic_blocks(cfg: ModelConfig, batch: int, seq: int, precision: str, flops: float) -> tuple[list[BlockProfile], BlockProfile]:
    """Per-block figures from the config: 2 FLOPs per weight per token forward (plus attention
    scores), backward twice that; saved activations per ANGEL-PTM Table 1 (34bsd + 5bs^2h for
    the block, in ``precision``), the block input b*s*d."""
    nbytes = PRECISION_BYTES[precision]
    b, s, d, h = batch, seq, cfg.d_model, cfg.n_head
    params = block_params(cfg)
    k = cfg.top_k if cfg.is_moe else 1
    matmul = 4 * d * d + 2 * d * cfg.d_ffn * k
    fwd = (2 * matmul * b * s + 4 * b * s * s * d) / flops
    act = int((34 * b * s * d + 5 * b * s * s * h) * nbytes / 2)
    blocks = [BlockProfile(f"blocks.{i}", fwd, 2 * fwd, params, act, b * s * d * nbytes) for i in range(cfg.n_layer)]
    rest_p = embedding_params(cfg)
    head = 2 * cfg.vocab_size * d * b * s / flops
    rest = BlockProfile("rest", head, 2 * head, rest_p, 2 * b * s * cfg.vocab_size * nbytes, b * s * d * nbytes)
    return blocks, rest


def analytic_profile(cfg: ModelConfig, batch: int, seq: int, precision: str = "fp32",
                     disk_dir: str | None = None) -> Profile:
    machine, flops = probe_machine(disk_dir)
    blocks, rest = analytic_blocks(cfg, batch, seq, precision, flops)
    return Profile(tuple(blocks), rest, machine, compute_bytes=PRECISION_BYTES[precision],
                   key=f"{socket.gethostname()}/{cfg.name or 'model'}/b{batch}s{seq}/{precision}/analytic")
