"""``tiertrain train --nproc N --pp P --plan auto``: the pipeline's stages planned once, before the ranks
start, by ``tiertrain plan --nproc N --pp P --schedule S --segments NS`` for the layout the run was given,
within each rank's budgets as the ranks will take them (what is taken from the machine shared by the N
ranks on it).

Why a process of its own: planning measures a block on the device, and a launcher that did so itself
would keep its CUDA context (and what its allocator caches) on GPU 0 for the whole run, beside rank 0.
Why once and not on each rank: the plan of a stage is the planner's answer for the model's profile, the
same on every rank; one file keeps them agreeing, and it stays in the run's directory
(``stage-plan.json``) for its resume.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.train.config import TrainConfig

STAGE_PLAN = "stage-plan.json"


def plan_stages(cfg: TrainConfig, nproc: int) -> Path:
    """Plan ``cfg``'s pipeline stages over ``nproc`` ranks of this machine into its run directory."""
    from tiertrain.train.run_dir import RunDir, RunDirTaken

    if cfg.resume:
        raise ConfigError("a resumed pipeline keeps the stage plan it was trained with (its stage-plan.json): leave "
                          "--plan auto out")
    out = Path(cfg.out).resolve()
    run_dir = RunDir(out)
    run_dir.refuse_if_busy()
    if run_dir.holds_a_run() and not cfg.overwrite:  # refused as the ranks would; --overwrite: rank 0 clears it
        raise RunDirTaken(f"{out} already holds a run's checkpoints or metrics; continue it with --resume {out}, "
                          "replace it with --overwrite, or give another --out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / STAGE_PLAN
    print(f"plan auto: planning the {cfg.pp}-stage pipeline's stages before the ranks start", flush=True)
    done = subprocess.run([sys.executable, "-m", "tiertrain", "plan", *_plan_args(cfg, nproc, _per_rank(cfg, nproc)),
                           "--out", str(path)], check=False)
    if done.returncode != 0:
        raise ConfigError(f"planning the stages failed (tiertrain plan said why above); fix that, or pass a plan: "
                          f"--plan stream|max-offload|FILE")
    return path


def _per_rank(cfg: TrainConfig, nproc: int) -> Budgets:
    """Each rank's budgets as the ranks take them (``api.machine_budgets``): what is taken from the machine
    (its host memory; on a CPU its device memory too) shared by the ``nproc`` ranks on it."""
    from tiertrain.api.machine_budgets import shared_tiers
    from tiertrain.memory.system import compute_device
    from tiertrain.train.tiered import default_budgets

    device = compute_device()
    taken = default_budgets(cfg, device)
    b, (share_device, share_host) = taken.budgets, shared_tiers(taken.taken, device)
    return Budgets(b.device // (nproc if share_device else 1), b.host // (nproc if share_host else 1),
                   b.disk, b.disk_dir)


def _plan_args(cfg: TrainConfig, nproc: int, budgets: Budgets) -> list[str]:
    """``tiertrain plan``'s flags for ``cfg``'s run: its model, a step's sequences, its precision, budgets,
    clipping, micro-batches and layout (expert parallel's too)."""
    from tiertrain.memory.system import compute_device
    from tiertrain.runtime.precision import choose_precision

    from tiertrain.models import config_vocab_and_len, resolve_config
    from tiertrain.train.config import SEQ_LEN

    seq = cfg.seq_len or min(SEQ_LEN, config_vocab_and_len(resolve_config(cfg.model))[1])  # as ``Trainer`` takes it
    args = ["--model", cfg.model, "--batch", str(cfg.batch_size * cfg.grad_accum), "--seq", str(seq),
            "--precision", choose_precision(cfg.precision, compute_device()).name,
            "--device-memory", str(budgets.device), "--host-memory", str(budgets.host),
            "--grad-clip", str(cfg.grad_clip), "--grad-accum", str(cfg.grad_accum), "--nproc", str(nproc),
            "--pp", str(cfg.pp), "--schedule", cfg.schedule, "--segments", str(cfg.segments)]
    if cfg.disk:
        args += ["--disk", cfg.disk]
    if cfg.page_size:
        args += ["--page-size", cfg.page_size]
    if cfg.ep > 1:  # each rank's stages planned with the experts it holds
        args += ["--ep", str(cfg.ep)]
    return args
