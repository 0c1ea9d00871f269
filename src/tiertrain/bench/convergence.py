"""Lockfree against sync where it matters: loss against wall-clock time on the built-in corpus.

``bench offload`` shows lockfree's steps are faster when the disk bounds the step; this bench
shows what those steps learn. The same disk-homed plan trains the same model from the same
seed with ``sync`` and with ``lockfree`` at each max staleness, and the bench prints each run's
loss curve over time, its loss over its last steps (per step), and its loss over the same
stretch of wall time (speed included). A lockfree run that steps faster but learns less per
step shows up here as no lower at equal time. At max staleness 1 it also runs lockfree at a fixed lag
(``Plan.fixed_lag``: every step exactly one step behind, reproducible, as a tensor-parallel group runs it).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tiertrain.bench.runtime import disk_bench_room, disk_home_plan, model_cfg
from tiertrain.train.config import TrainConfig
from tiertrain.train.metrics import Reporter
from tiertrain.models import param_count

SMOOTH = 25  # steps in the moving average of the loss (one sequence per step is noisy)


@dataclass
class Curve:
    label: str
    seconds: np.ndarray      # wall seconds of training at the end of each step (step times summed)
    raw: np.ndarray          # each step's loss
    staleness: int           # the most steps a block's params lagged (0 for sync)

    @property
    def smooth(self) -> np.ndarray:
        """Moving average of the loss over the last SMOOTH steps (fewer at first)."""
        total = np.concatenate([[0.0], np.cumsum(self.raw)])
        ends = np.arange(1, len(self.raw) + 1)
        starts = np.maximum(ends - SMOOTH, 0)
        return (total[ends] - total[starts]) / (ends - starts)

    def mean_between(self, t0: float, t1: float) -> float:
        """Mean loss of the steps that ended in (t0, t1]: many steps, so less noise than one point. On a
        loaded machine a run may have finished none there: then the loss of its last step ended by t1,
        or, with none ended by then, its first (the model was still the initial one)."""
        inside = (self.seconds > t0) & (self.seconds <= t1)
        if inside.any():
            return float(self.raw[inside].mean())
        before = np.flatnonzero(self.seconds <= t1)
        return float(self.raw[before[-1]] if before.size else self.raw[0])


def _curve(label: str, out: Path) -> Curve:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return Curve(label, np.cumsum([r["step_s"] for r in rows]), np.array([r["loss"] for r in rows]),
                 max(r.get("staleness", 0) for r in rows))


def _run(label: str, update: str, staleness: int, base: dict, work: Path, plan: Path | None = None) -> Curve:
    from tiertrain.train.loop import train

    out = work / label
    given = base if plan is None else {**base, "plan": str(plan)}
    cfg = TrainConfig(**given, update=update, max_staleness=staleness, out=str(out))
    train(cfg, Reporter(cfg.steps, cfg.log_every, quiet=True))
    return _curve(label, out)


def bench_convergence(d: int, layers: int, batch: int, seq: int, steps: int, lr: float, disk_dir: str | None,
                      stalenesses: tuple[int, ...], out: Callable[[str], None], page: int = 1 << 20,
                      points: int = 8) -> dict:
    """Sync and lockfree (one run per max staleness) on the same disk-homed streamed plan, ``page``-byte pages."""
    cfg = model_cfg(d, layers)
    work = Path(tempfile.mkdtemp(prefix="tiertrain-convergence-", dir="."))
    disk = Path(disk_dir) if disk_dir else work / "disk"
    plan_file = work / "plan.json"
    plan_file.write_text(disk_home_plan(layers, "sync").to_json())
    fixed_file = work / "fixed.json"
    fixed_file.write_text(dataclasses.replace(disk_home_plan(layers, "lockfree"), fixed_lag=True).to_json())
    room = f"{disk_bench_room(param_count(cfg), layers, page) >> 20}MiB"
    base = dict(model=cfg, steps=steps, batch_size=batch, seq_len=seq, lr=lr, grad_clip=0.0, plan=str(plan_file),
                device_memory=room, host_memory=room, disk=f"{disk}:{room}", page_size=f"{page >> 10}KiB",
                log_every=10 ** 6, seed=0)
    out(f"model d_model {d}, {layers} layers; batch {batch} x {seq}, {steps} steps, lr {lr}, no clipping; "
        f"plan: master and moments on disk, blocks streamed; built-in corpus; loss smoothed over {SMOOTH} steps")
    runs = [("sync", "sync", 0, None)] + [(f"lockfree{s}", "lockfree", s, None) for s in stalenesses]
    runs += [("fixed1", "lockfree", 1, fixed_file)] if 1 in stalenesses else []
    curves = [_run(label, update, s, base, work, plan) for label, update, s, plan in runs]
    _print_curves(curves, points, out)
    fastest = min(c.seconds[-1] for c in curves)
    tail = len(curves[0].raw) // 4
    results = {"equal_time_s": float(fastest)}
    for c in curves:
        at_fastest = c.mean_between(fastest / 2, fastest)
        last = float(c.raw[-tail:].mean())
        results[c.label] = {"step_s": float(c.seconds[-1] / len(c.seconds)), "first_loss": float(c.raw[0]),
                            "last_steps_loss": last, "loss_at_equal_time": at_fastest, "staleness": c.staleness}
        sync = results["sync"]
        out(f"{c.label:10s}: {results[c.label]['step_s']:.3f} s per step, staleness up to {c.staleness}; "
            f"loss in the last {tail} steps {last:.3f} ({last - sync['last_steps_loss']:+.3f} against sync); "
            f"in {fastest / 2:.0f}..{fastest:.0f} s {at_fastest:.3f} ({at_fastest - sync['loss_at_equal_time']:+.3f})")
    out(f"every run sees the same batch at the same step, so the last {tail} steps' loss compares what the runs "
        f"learnt per step; the loss between {fastest / 2:.0f} and {fastest:.0f} s of training (the fastest run's "
        "second half) compares them at equal time, speed included")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return results


def _print_curves(curves: list[Curve], points: int, out: Callable[[str], None]) -> None:
    """Each run's smoothed loss at evenly spaced wall times (up to the slowest run's end)."""
    end = max(c.seconds[-1] for c in curves)
    out("loss over wall time (s):  " + "  ".join(f"{c.label:>10s}" for c in curves))
    for t in np.linspace(end / points, end, points):
        cells = []
        for c in curves:
            smooth = c.smooth
            i = np.searchsorted(c.seconds, t, side="right") - 1
            cells.append(f"{'-':>10s}" if i < 0 else f"{smooth[i]:10.3f}" if t <= c.seconds[-1] + 1e-9
                         else f"{'(done)':>10s}")
        out(f"  {t:7.1f}                 " + "  ".join(cells))
