"""Runtime benchmarks, each figure beside its limit measured in the same run.

``optimizer``: AdamW throughput of tiertrain's per-block update over a GPT's real block
chunks, against the memory-bandwidth bound (an in-place STREAM add on 2 threads; AdamW moves
about 28 bytes per parameter) and against torch's fused AdamW over the same parameters.

``offload``: step time of a disk-homed plan against max(compute time, disk I/O time),
where compute is the same model's plain forward+backward and disk I/O is the states'
bytes (read and written) at the raw O_DIRECT bandwidth measured here. Each plan's process
CPU time per step is printed too: on a CPU-only machine the "device" is the same cores that
copy, checksum and update, so the CPU work divided by the cores is a second bound there.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tiertrain.bench.machine import synchronize
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw
from tiertrain.memory import Budgets
from tiertrain.memory.system import compute_device
from tiertrain.models import ModelConfig, build, param_count
from tiertrain.plan import Plan
from tiertrain.units import format_bytes

ADAMW_BYTES_PER_PARAM = 28  # read param, grad, m, v (16) + write param, m, v (12)


def stream_inplace_add(nbytes: int, threads: int) -> float:
    """Memory bandwidth of an in-place ``a += b`` (bytes moved per second), ``threads`` numpy threads.

    In-place, like AdamW: every byte written was just read, so there is no write-allocate
    traffic that a STREAM *copy* moves without counting (which made copy's figure ~1.5x
    too low a bound here: torch's fused AdamW beat it). Counts 12 bytes per fp32 element.
    """
    per = nbytes // 4 // threads
    a = [np.ones(per, dtype=np.float32) for _ in range(threads)]
    b = [np.ones(per, dtype=np.float32) for _ in range(threads)]
    best = 0.0
    for _ in range(5):
        ts = [threading.Thread(target=np.add, args=(x, y), kwargs={"out": x}) for x, y in zip(a, b)]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = max(best, 12 * per * threads / (time.perf_counter() - t))
    return best


def model_cfg(d: int, layers: int, max_seq_len: int = 256) -> ModelConfig:
    """The benches' GPT: byte-level vocabulary, so the built-in corpus trains it as it is."""
    return ModelConfig(n_layer=layers, n_head=8, d_model=d, d_ffn=4 * d, vocab_size=256, max_seq_len=max_seq_len,
                       name="bench")


def _fill_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def disk_bench_room(n: int, layers: int, page: int) -> int:
    """Bytes per tier that hold a disk-homed plan of the bench model of ``n`` params in whole pages
    (several per chunk at most): the disk, not a budget, sets the pace."""
    return max(256 << 20, 64 * n, 16 * (layers + 1) * page)


def disk_home_plan(n_blocks: int, update: str, stream: bool = True, max_staleness: int = 1) -> Plan:
    """fp32 master and moments homed on disk, no recompute, so the compute is exactly the plain
    forward+backward and the disk traffic exactly the states': the bound below is fair.
    ``stream``: blocks go through a 2-slot window with their compute params kept on the host too
    (ANGEL-PTM's layout); else they stay on the device (ZeRO-Infinity's, when params fit)."""
    from tiertrain.memory import Tier
    from tiertrain.plan import BlockPlan

    block = BlockPlan(home=Tier.DISK, stream=stream, param_copy=stream)
    return Plan((block,) * n_blocks, BlockPlan(home=Tier.DISK), window=2, prefetch=1, update=update,
                name="stream-disk" if stream else "resident-disk", max_staleness=max_staleness)


def _tiered(cfg: ModelConfig, budgets: Budgets, plan, update: str, page: int):
    import tiertrain

    model = build(cfg)
    opt, _ = make_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    return tiertrain.setup(model, opt, budgets, plan=plan, update=update, page_size=page)


def bench_optimizer(d: int, layers: int, repeats: int, out: Callable[[str], None]) -> dict:
    cfg = model_cfg(d, layers)
    n = param_count(cfg)
    bound = stream_inplace_add(512 << 20, torch.get_num_threads()) / ADAMW_BYTES_PER_PARAM
    model = build(cfg)
    opt, _ = make_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    room = max(256 << 20, 40 * n)  # whole pages per chunk make small models need more than 24 B/param
    tm, _ = _tiered(cfg, Budgets(device=room, host=room), "stream", "sync", 1 << 20)
    rt = tm.runtime
    peer, ours = [], []
    for _ in range(repeats + 1):  # alternate the peer and ours; the first round warms up
        _fill_grads(model)
        t = time.perf_counter()
        opt.step()
        peer.append(n / (time.perf_counter() - t))
        for g in rt.groups:  # gradients as backward leaves them, flushed into each block's grad chunk (untimed)
            for p in g.params:
                p.grad = torch.empty_like(p).normal_(0, 1e-3)
            g.post_backward()
        t = time.perf_counter()
        for g in rt.groups:
            g.update_now(rt.hypers(), None)
        ours.append(n / (time.perf_counter() - t))
    rt.close()
    rt.mem.close()
    p, o = statistics.median(peer[1:]), statistics.median(ours[1:])
    out(f"AdamW on {n / 1e6:.1f}M params in {layers + 1} block chunks, {torch.get_num_threads()} threads: "
        f"tiertrain {o / 1e6:.0f} M params/s (min {min(ours[1:]) / 1e6:.0f}, max {max(ours[1:]) / 1e6:.0f}), "
        f"torch fused AdamW {p / 1e6:.0f} M params/s, memory-bandwidth bound {bound / 1e6:.0f} M params/s")
    out(f"optimizer throughput {o / bound:.2f} of the bandwidth bound (target >= 0.80), {o / p:.2f} of torch fused")
    return {"params": n, "tiertrain": o, "torch_fused": p, "bound": bound}


def _step_times(step: Callable[[], None], repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of each step after one warm-up, device work included; ``cpu`` receives each
    step's process CPU seconds (all threads: compute, copies, I/O, checksums, the optimizer)."""
    device = compute_device()
    step()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        c, t = time.process_time(), time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.process_time() - c)
    return times


def _offload_run(cfg: ModelConfig, budgets: Budgets, plan, label: str, page: int, x: torch.Tensor, repeats: int,
                 bound: float, cores: int, out: Callable[[str], None]) -> dict:
    """One plan's steps, printed beside the bound; lockfree also prints the staleness its steps saw."""
    update = "lockfree" if label.startswith("lockfree") else label
    tm, topt = _tiered(cfg, budgets, plan, update, page)
    rt = tm.runtime
    seen: list[int] = []

    def step() -> None:
        lm_loss(tm, x[:, :-1], x[:, 1:]).backward()
        topt.step()
        topt.zero_grad()
        seen.append(rt.pop_staleness())

    cpu: list[float] = []
    times = _step_times(step, repeats, cpu)
    rt.close()
    rt.mem.close()
    # the mean, not the median: lockfree passes come every few steps, and throughput includes them
    mean, cpu_s = statistics.fmean(times), statistics.fmean(cpu)
    name = plan if isinstance(plan, str) else plan.name
    note = {"max-offload": " (recomputes: its compute exceeds the bound by one forward)",
            "lockfree": f" (staleness seen up to {max(seen[1:])} steps; an update takes every gradient gathered since "
                        "the last, so fewer disk passes than steps: it may beat this bound)"}.get(
        name if name == "max-offload" else update, "")
    out(f"{name:13s} {label:9s}: step {mean:.3f} s mean (min {min(times):.3f}, max {max(times):.3f}); "
        f"overlap efficiency {bound / mean:.2f} (bound {bound:.3f} s, target >= 0.85){note}; "
        f"CPU {cpu_s:.2f} s per step, {cpu_s / cores:.3f} s on {cores} cores: "
        f"{max(bound, cpu_s / cores) / mean:.2f} of max(bound, CPU work / cores)")
    return {"step_s": mean, "min_s": min(times), "max_s": max(times), "efficiency": bound / mean,
            "cpu_s": cpu_s, "cores_bound_s": cpu_s / cores, "staleness": max(seen[1:])}


def bench_offload(d: int, layers: int, batch: int, seq: int, disk_dir: str | None, repeats: int,
                  out: Callable[[str], None], page: int = 1 << 20, stalenesses: tuple[int, ...] = (1, 4)) -> dict:
    """``stalenesses``: lockfree runs with each ``max_staleness`` (the first is compared with sync
    per layout; each lockfree line prints the staleness it actually saw)."""
    from tiertrain.bench.memory import raw_disk

    cfg = model_cfg(d, layers)
    n = param_count(cfg)
    x = torch.randint(0, 256, (batch, seq + 1), device=compute_device())
    directory = Path(disk_dir or tempfile.mkdtemp(prefix="tiertrain-bench-", dir="."))
    directory.mkdir(parents=True, exist_ok=True)
    plain = build(cfg).to(x.device)

    def compute() -> None:
        lm_loss(plain, x[:, :-1], x[:, 1:]).backward()
        plain.zero_grad(set_to_none=True)

    state_bytes = 12 * n  # fp32 master + two moments, read and written each step
    raw = raw_disk(directory, max(state_bytes, 64 << 20), 1 << 20, 8)
    plain_cpu: list[float] = []
    compute_s = statistics.median(_step_times(compute, repeats, plain_cpu))
    io_s = state_bytes / raw.read + state_bytes / raw.write
    opt_s = n * ADAMW_BYTES_PER_PARAM / stream_inplace_add(512 << 20, torch.get_num_threads())
    bound = max(compute_s, io_s, opt_s)
    room = disk_bench_room(n, layers, page)
    budgets = Budgets(device=room, host=room, disk=room, disk_dir=str(directory))
    results = {"params": n, "compute_s": compute_s, "disk_io_s": io_s, "optimizer_s": opt_s, "bound_s": bound}
    out(f"model {n / 1e6:.1f}M params, batch {batch} x {seq}; states on disk: {state_bytes / 2**20:.0f} MiB each way; "
        f"pages of {format_bytes(page)}")
    out(f"limits measured here: compute {compute_s:.3f} s (plain fwd+bwd), disk I/O {io_s:.3f} s "
        f"(raw O_DIRECT {raw.read / 1e9:.2f} GB/s read, {raw.write / 1e9:.2f} GB/s write), "
        f"optimizer {opt_s:.3f} s (bandwidth bound)")
    cores = os.cpu_count() or 1
    out(("disk-bound: disk I/O exceeds compute" if io_s > compute_s else
         "NOT disk-bound here (compute exceeds disk I/O): lower --batch-size for the disk-bound case") +
        f"; plain fwd+bwd keeps {statistics.median(plain_cpu) / compute_s:.1f} of {cores} cores busy")
    runs = [("stream-disk", disk_home_plan(layers, "sync"), "sync"),
            ("stream-disk", disk_home_plan(layers, "overlap"), "overlap")]
    runs += [("stream-disk", disk_home_plan(layers, "lockfree", max_staleness=s), f"lockfree{s}") for s in stalenesses]
    runs += [("resident-disk", disk_home_plan(layers, "sync", stream=False), "sync")]
    runs += [("resident-disk", disk_home_plan(layers, "lockfree", stream=False, max_staleness=s), f"lockfree{s}")
             for s in stalenesses]
    runs += [("max-offload", "max-offload", "overlap")]
    for name, plan, label in runs:
        results[f"{name}/{label}"] = _offload_run(cfg, budgets, plan, label, page, x, repeats, bound, cores, out)
    for name in ("stream-disk", "resident-disk"):
        for s in stalenesses:
            speedup = results[f"{name}/sync"]["step_s"] / results[f"{name}/lockfree{s}"]["step_s"]
            out(f"lockfree (max staleness {s}) against sync, {name}: {speedup:.2f}x faster per step "
                f"(target >= 2; ANGEL-PTM 2.96x, with no staleness bound)")
    if disk_dir is None:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    return results
