"""One real training run of a model, in its own process, judged by what it wrote: ``bench largest``'s
trial. A process of its own because a model too large for the machine may die of it (the kernel's
out-of-memory killer, a CUDA allocation) and must take nothing of the search with it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tiertrain.models.config import ModelConfig

# a run refused (exit 2) for its size says one of these; any other refusal is the options', fatal to the search
SIZE_WORDS = re.compile(r"fit|budget|memory|no space", re.IGNORECASE)


@dataclass(frozen=True)
class TrainArgs:
    """What every trial trains with but its model: budgets, batch shape, precision, steps."""

    device_memory: str
    host_memory: str
    disk: str | None
    batch_size: int
    seq_len: int
    precision: str
    steps: int
    timeout_s: float
    device: str = "auto"
    lr: float = 1e-4    # with no warm-up in 3 steps, 2e-3 (train's default) took a 0.9B's loss from 11 to 22
    update: str = "sync"
    grad_clip: float = 1.0  # clipping keeps every block's gradient until the norm is known (sync)
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Trial:
    """A model's run: whether it trained every step with finite losses, and why not where it did not."""

    cfg: ModelConfig
    params: int
    trained: bool
    why: str = ""
    step_s: float | None = None          # median step after the first (compile, warm-up)
    peaks: dict[str, int] = field(default_factory=dict)  # per tier, the run's last row's
    losses: tuple[float, ...] = ()
    seconds: float = 0.0
    fatal: bool = False  # refused for another reason than its size (a bad option): no trial will train


def command(cfg_file: Path, out: Path, args: TrainArgs) -> list[str]:
    cmd = [sys.executable, "-m", "tiertrain.cli.main", "train", "--model", str(cfg_file), "--plan", "auto",
           "--device-memory", args.device_memory, "--host-memory", args.host_memory,
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--precision", args.precision,
           "--steps", str(args.steps), "--warmup-steps", "0", "--lr", str(args.lr), "--log-every", "1",
           "--device", args.device, "--update", args.update, "--grad-clip", str(args.grad_clip),
           "--out", str(out), "--no-save", "--quiet", *args.extra]
    return cmd + (["--disk", args.disk] if args.disk else [])


def judge(cfg: ModelConfig, params: int, rc: int | None, rows: list[dict], stderr: str, steps: int,
          seconds: float, timeout_s: float) -> Trial:
    """A run trained when it exited 0 having written every step's row with a finite loss."""
    losses = tuple(float(r["loss"]) for r in rows)
    times = [float(r["step_s"]) for r in rows[1:]]
    peaks = dict(rows[-1].get("peak_bytes", {})) if rows else {}
    common = {"step_s": statistics.median(times) if times else None, "peaks": peaks, "losses": losses,
              "seconds": seconds}
    if rc is None:
        return Trial(cfg, params, False, f"ran past {timeout_s:.0f} s (step {len(rows)} of {steps})", **common)
    if rc != 0:
        why = _failure(rc, stderr)
        return Trial(cfg, params, False, why, fatal=rc == 2 and not SIZE_WORDS.search(why), **common)
    if len(rows) < steps or not all(math.isfinite(v) for v in losses):
        return Trial(cfg, params, False, f"exited 0 after {len(rows)} of {steps} steps, losses {losses}", **common)
    return Trial(cfg, params, True, "", **common)


def _failure(rc: int, stderr: str) -> str:
    if rc < 0:
        name = signal.Signals(-rc).name
        return f"killed by {name}" + (" (out of memory?)" if -rc == signal.SIGKILL else "")
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return f"exit {rc}: {lines[-1][:300] if lines else 'no message'}"


def read_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line: the run died writing it
    return rows


def run_trial(cfg: ModelConfig, params: int, args: TrainArgs) -> Trial:
    """Train ``cfg`` for ``args.steps`` steps with ``--plan auto`` in a child process, its run directory
    removed after (no checkpoint is written: ``--no-save``), and whatever it left in the disk directory
    (a killed run's page files): only what was not there before, never the directory itself. The directory
    must be the caller's alone (``bench_largest`` makes a private one): another process's files made there
    meanwhile would go too."""
    import time

    work = Path(tempfile.mkdtemp(prefix="tiertrain-largest-"))
    where = Path(args.disk.rsplit(":", 1)[0]) if args.disk else None
    before = set(os.listdir(where)) if where is not None else set()
    try:
        cfg_file = work / "model.json"
        cfg_file.write_text(json.dumps(cfg.to_dict()))
        began = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            proc = subprocess.run(command(cfg_file, work / "run", args), check=False, capture_output=True,
                                  text=True, timeout=args.timeout_s, env=env)
            rc, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stderr = None, exc.stderr or ""
        rows = read_rows(work / "run" / "metrics.jsonl")
        return judge(cfg, params, rc, rows, stderr if isinstance(stderr, str) else stderr.decode(errors="replace"),
                     args.steps, time.perf_counter() - began, args.timeout_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for name in set(os.listdir(where)) - before if where is not None else ():
            shutil.rmtree(where / name, ignore_errors=True)
