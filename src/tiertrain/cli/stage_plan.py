"""``tiertrain train --nproc N --pp P --plan auto``: the pipeline's stages planned once, before the ranks
start, as ``tiertrain plan --nproc N --pp P`` plans them, for the layout the run was given (its schedule,
segments and micro-batches), within each rank's budgets as the ranks will take them.

Why here and not in each rank: the plan of a stage is the planner's answer for the model's profile, the
same on every rank; planning once and handing every rank one file keeps them agreeing, and the file stays
in the run's directory (``stage-plan.json``) for its resume.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from tiertrain.errors import ConfigError
from tiertrain.plan.pipeline import PipelineLayout
from tiertrain.train.config import TrainConfig

STAGE_PLAN = "stage-plan.json"


def plan_stages(cfg: TrainConfig, nproc: int, console: Console) -> Path:
    """Plan ``cfg``'s pipeline stages over ``nproc`` ranks and write the plan into its run directory."""
    from tiertrain.checkpoint.atomic import write_atomic
    from tiertrain.cli.plan import PlanRequest, run_plan
    from tiertrain.memory.system import compute_device
    from tiertrain.plan import DEFAULT_MAX_STALENESS
    from tiertrain.runtime.precision import choose_precision
    from tiertrain.train.run_dir import RunDir
    from tiertrain.train.tiered import default_budgets

    out = Path(cfg.out)
    run_dir = RunDir(out)
    run_dir.refuse_if_busy()
    if not cfg.resume:
        run_dir.claim_for_new_run(cfg.overwrite)  # as the ranks would: never into another run's directory
    device = compute_device()
    budgets = default_budgets(cfg, device).budgets
    layout = PipelineLayout(cfg.pp, cfg.schedule, cfg.grad_accum, cfg.segments)
    req = PlanRequest(model=cfg.model, batch=cfg.batch_size * cfg.grad_accum, seq=cfg.seq_len,
                      precision=choose_precision(cfg.precision, device).name, device_memory=str(budgets.device),
                      host_memory=str(budgets.host), disk=cfg.disk, profile_file=None, solvers=(), levels=None,
                      page_size=cfg.page_size, update="sync", max_staleness=DEFAULT_MAX_STALENESS,
                      grad_clip=cfg.grad_clip, grad_accum=cfg.grad_accum, machine=None, max_model=False,
                      measure_memory=None, measure_seconds=None, nproc=nproc, pp=cfg.pp, layout=layout)
    console.print(f"plan auto: planning each rank's stages of the {cfg.pp}-stage pipeline before the ranks start")
    chosen = run_plan(req, console)
    if chosen.plan is None:
        raise ConfigError(f"no plan fits a stage of the pipeline in its budgets: give --pp more stages, fewer "
                          "--segments, or more --device-memory/--host-memory/--disk")
    out.mkdir(parents=True, exist_ok=True)
    path = out / STAGE_PLAN
    write_atomic(path, chosen.plan.to_json().encode())
    console.print(f"stage plan written to {path}")
    return path
