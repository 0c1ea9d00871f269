"""Where profiles come from: a quick probe of the machine, and per-block figures.

Per-block figures are either measured on the real model (``engine.profiling``: warm-up
steps with timing hooks and a saved-tensor counter; it runs the model, so it lives in the
engine) or derived from the config here (``analytic_blocks``: FLOPs at the probed matmul
rate, and ANGEL-PTM Table 1's activation sizes, for models too big to run here). Machine probes
are cached per host name in the tiertrain cache directory.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tiertrain.memory.disk_probe import measure_disk
from tiertrain.memory.page_size import cache_dir
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
