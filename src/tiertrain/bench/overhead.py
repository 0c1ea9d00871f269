"""What tiertrain costs on a model that fits: plain PyTorch against the ``resident`` plan.

The resident plan keeps every state on the device, so the only difference from a plain loop
is tiertrain itself: module and gradient hooks, gradients flushed into per-block host chunks,
per-block AdamW (ANGEL-PTM measured 2.4% on GPUs; our target is 3%). Each variant runs a few
steps per round, the rounds interleaved, so the machine's drift hits every variant alike; the
overhead is the median over rounds of the per-round ratio.

Tokens/s and model FLOPs utilisation are printed beside a matrix product timed in the same
run at the same precision, the ceiling the model's matmuls could reach on this device.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from tiertrain.bench.machine import synchronize as _sync
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw
from tiertrain.runtime.precision import Precision
from tiertrain.memory import Budgets
from tiertrain.memory.system import compute_device
from tiertrain.models import ModelConfig, build, param_count
from tiertrain.models.accounting import flops_per_token
from tiertrain.precisions import torch_dtype



def matmul_peak(device: torch.device, precision: str) -> float:
    """FLOP/s of a square matrix product at ``precision`` on ``device`` (best of 5, after a warm-up),
    on random data: the ceiling model FLOPs utilisation is measured against."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch_dtype(precision))
    b = torch.randn(n, n, device=device, dtype=torch_dtype(precision))
    a @ b
    best = 0.0
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t))
    return best


def _plain(cfg: ModelConfig, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build(cfg).to(device)
    opt, _ = make_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.1)
    return model, opt


def _tiered(cfg: ModelConfig, update: str, precision: str) -> tuple[torch.nn.Module, object]:
    import tiertrain

    torch.manual_seed(0)
    model = build(cfg)
    opt, _ = make_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.1)
    room = 32 * param_count(cfg) + (1 << 30)  # resident: every state fits, whole pages included
    return tiertrain.setup(model, opt, Budgets(device=room, host=room), plan="resident", update=update,
                           compute_dtype=precision)


def _stepper(model: torch.nn.Module, opt, x: torch.Tensor, device: torch.device,
             precision: str) -> Callable[[], None]:
    def step() -> None:
        with Precision(precision, device.type).autocast():
            loss = lm_loss(model, x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Mean seconds per step over ``steps`` steps, device work included."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t) / steps


def bench_overhead(cfg: ModelConfig, batch: int, seq: int, precision: str, updates: tuple[str, ...],
                   rounds: int, steps: int, out: Callable[[str], None]) -> dict:
    """Plain PyTorch and the resident plan with each update mode in ``updates``, interleaved."""
    device = compute_device()
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    runs: dict[str, Callable[[], None]] = {}
    closers = []
    plain, popt = _plain(cfg, device)
    runs["plain"] = _stepper(plain, popt, x, device, precision)
    for update in updates:
        tm, topt = _tiered(cfg, update, precision)
        runs[f"resident/{update}"] = _stepper(tm, topt, x, device, precision)
        closers.append(tm.runtime)
    for step in runs.values():  # warm-up: allocator, kernels, the first AdamW states
        _timed(step, 2, device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, step in runs.items():
            times[name].append(_timed(step, steps, device))
    for rt in closers:
        rt.close()
        rt.mem.close()
    peak = matmul_peak(device, precision)
    flops = flops_per_token(cfg, seq) * batch * seq
    n = param_count(cfg)
    out(f"model {n / 1e6:.1f}M params, batch {batch} x {seq}, {precision} on {device.type}; "
        f"{rounds} interleaved rounds of {steps} steps per variant")
    out(f"matrix product at {precision} measured here: {peak / 1e12:.2f} TFLOP/s (the MFU ceiling)")
    results = {"params": n, "matmul_flops": peak}
    for name, ts in times.items():
        mean = statistics.median(ts)
        ratios = [t / p - 1 for t, p in zip(ts, times["plain"])]
        overhead = statistics.median(ratios)
        tail = ("" if name == "plain" else
                f"; overhead against plain {100 * overhead:+.1f}% (rounds {100 * min(ratios):+.1f}% .. "
                f"{100 * max(ratios):+.1f}%; target <= 3%, ANGEL-PTM 2.4%)")
        out(f"{name:17s}: step {mean:.4f} s, {batch * seq / mean:,.0f} tokens/s, "
            f"MFU {flops / mean / peak:.2f}{tail}")
        results[name] = {"step_s": mean, "tokens_per_s": batch * seq / mean, "mfu": flops / mean / peak,
                         "overhead": overhead, "overhead_rounds": ratios}
    return results
