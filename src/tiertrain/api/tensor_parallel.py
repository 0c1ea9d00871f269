"""``tiertrain.tensor_parallel``: a model's blocks cut over groups of ``tp`` ranks (Megatron's layout:
attention heads and MLP features split), each rank's shards in tiers::

    run = tiertrain.tensor_parallel(model, torch.optim.AdamW(model.parameters(), lr=3e-4), tp=2, plan="stream")
    for x, y in batches[run.mesh.dp_rank]:   # every rank of a tensor-parallel group reads the same batch
        loss = lm_loss(run.model, x, y); loss.backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)   # the norm over every shard
        run.optimizer.step(); scheduler.step(); run.optimizer.zero_grad()

The ranks form a dp x tp mesh (``parallel.tensor_mesh``); each rank tiers its shards with
``tiertrain.setup`` over its shard's data-parallel group, so every tier plan and data-parallel layout
works on them unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiertrain.api.setup import optimizer_groups, run_options, setup
from tiertrain.api.tiered_optimizer import TieredOptimizer
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.parallel.agree import same_on_every_rank
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.group import ensure_process_group, world_from_env
from tiertrain.parallel.sequence_ops import sum_whole_gradients
from tiertrain.parallel.tensor_mesh import TensorMesh, tensor_mesh
from tiertrain.parallel.tensor_parallelize import parallelize
from tiertrain.parallel.tensor_plans import (
    check_sequence_parallel,
    check_tensor_parallel,
    split_of,
)
from tiertrain.plan import BUILTIN_PLANS, DEFAULT_MAX_STALENESS, Plan, RunOptions
from tiertrain.plan.plan import plan_file
from tiertrain.plan.update_modes import check_group_reads_alike, lags_one_step
from tiertrain.runtime.rank_agreement import model_signature

FIX = "start every rank with the same model, --tp and plan (torchrun gives each rank the same command line)"


@dataclass
class TensorParallel:
    """One rank's part of a tensor-parallel run: its shards of the model (tiered), the optimizer its loop
    steps, and the mesh (``mesh.dp_rank``: the replica whose batches this rank reads)."""

    model: nn.Module
    optimizer: TieredOptimizer
    mesh: TensorMesh

    def close(self) -> None:
        """The runtime and its memory, then the mesh's heartbeat."""
        try:
            self.model.runtime.close()
            self.model.runtime.mem.close()
        finally:
            self.mesh.close()


def tensor_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, tp: int, memory: Budgets | None = None,
                    plan: str | Plan = "stream", options: RunOptions | None = None, sequence_parallel: bool = False,
                    **fields: Any) -> TensorParallel:
    """Cut ``model``'s blocks over groups of ``tp`` ranks, tier this rank's shards as ``plan`` says within
    ``memory`` (this rank's budgets), and return what the loop drives. ``options`` (or its fields as
    keywords) as ``tiertrain.setup`` takes them. ``sequence_parallel``: between the cut regions each rank
    holds its slice of the sequence (norms and residuals 1/T each; a mixture of experts runs whole between the
    slices). The user's optimizer is
    pointed at this rank's shards."""
    opts = run_options(options, fields)
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, not {tp}")
    cut = check_tensor_parallel(model, tp)
    if sequence_parallel:
        check_sequence_parallel(model, cut)
    if isinstance(plan, str) and plan not in BUILTIN_PLANS and plan != "auto":
        plan = plan_file(plan)  # its update mode and dtype checked as given ones
    if isinstance(plan, Plan):
        plan.parallel.check_run(tp, sequence_parallel, "the plan")
    check_tensor_plan(plan, opts)
    opts = lag_in_group(plan, opts)
    optimizer_groups(optimizer, model)  # an AdamW, fresh, over every parameter: refused before anything changes
    world = world_from_env()
    if world % tp:
        raise ConfigError(f"--tp {tp} must divide the run's {world} ranks: give --nproc a multiple of --tp")
    ensure_process_group()
    same_on_every_rank("tensor parallel", {**_fields(model, tp, opts, plan),
                                           "sequence parallel": str(sequence_parallel)}, FIX)
    mesh = tensor_mesh(tp)
    try:
        new_of = parallelize(model, mesh.tp_rank, mesh.tp_group, sequence_parallel)
        for group in optimizer.param_groups:
            group["params"] = [new_of.get(id(p), p) for p in group["params"]]
        tiered, topt = setup(model, optimizer, memory, plan=plan, options=opts, collectives=mesh.dp_group)
    except BaseException:
        mesh.close()
        raise
    norm_over_group(tiered, mesh.tp_group)
    if sequence_parallel:
        sum_whole_gradients(tiered, cut.whole_in_block, mesh.tp_group)
    return TensorParallel(tiered, topt, mesh)


def norm_over_group(tiered: nn.Module, group: Collectives) -> None:
    """The step's gradient norm over every shard: each rank's own, summed over its tensor-parallel
    ``group``, with a whole parameter (the same gradient on every rank of the group) counted on the
    group's first rank only."""
    runtime = tiered.runtime
    runtime.norm.sum_over(group)
    if group.rank == 0:
        return
    for name, param in tiered.named_parameters():
        if split_of(name) is None:
            runtime.leave_out_of_norm(param)


def check_tensor_plan(plan: str | Plan, opts: RunOptions) -> None:
    """Every rank of a group must run its blocks alike (a recomputed block sums its activations again):
    a plan each rank finds for itself could differ, and params of another age on each rank (a free update
    loop's lag above one step) would part the whole parameters. fp16's loss scale is not agreed over the group."""
    check_group_reads_alike(*_update_and_lag(plan, opts), "give max_staleness=1 (a fixed lag of one step) or 0, "
                            "or update 'sync' or 'overlap'")
    if (opts.compute_dtype or (plan.compute_dtype if isinstance(plan, Plan) else "fp32")) == "fp16":
        raise ConfigError("tensor-parallel runs compute in fp32 or bf16, not fp16: use bf16")
    if isinstance(plan, str) and plan == "auto":
        raise ConfigError("tensor parallel takes a named plan or a plan file, not plan 'auto' yet (each rank would "
                          "profile and choose alone): give --plan stream, max-offload, ... or a file from "
                          "`tiertrain plan`")


def lag_in_group(plan: str | Plan, opts: RunOptions) -> RunOptions:
    """The options a tensor-parallel group's ranks run with: a lockfree loop at max staleness 1 runs at a
    fixed lag (``Plan.fixed_lag``), so that every rank of the group reads each block at one age."""
    update, lag = _update_and_lag(plan, opts)
    if not lags_one_step(update, lag) or opts.fixed_lag:
        return opts
    if opts.fixed_lag is False:
        raise ConfigError("fixed_lag=False lets each rank's lockfree loop lag on its own clock, and a tensor-parallel "
                          "group's ranks must read each block at one age: leave fixed_lag out (the group runs at a "
                          "fixed lag), or give max_staleness=0")
    if int(os.environ.get("RANK", "0")) == 0:
        print("tiertrain: lockfree updates run at a fixed lag of one step in a tensor-parallel group (every rank "
              "reads each block's params exactly one step old)", file=sys.stderr)
    return dataclasses.replace(opts, fixed_lag=True)


def _update_and_lag(plan: str | Plan, opts: RunOptions) -> tuple[str, int]:
    """The run's update mode and max staleness: the options', else the plan's."""
    update = opts.update or (plan.update if isinstance(plan, Plan) else "sync")
    lag = opts.max_staleness if opts.max_staleness is not None else (
        plan.max_staleness if isinstance(plan, Plan) else DEFAULT_MAX_STALENESS)
    return update, lag


def _fields(model: nn.Module, tp: int, opts: RunOptions, plan: str | Plan) -> dict[str, str]:
    """What every rank must hold alike: a rank that recomputes, clips or cuts otherwise issues other sums."""
    return {"--tp": str(tp), "the model (its parameters' names, shapes and dtypes)": model_signature(model),
            "built on the meta device": str(built_on_meta(model)),  # a group's ranks start from one model alike
            "the run's options": json.dumps(dataclasses.asdict(opts), sort_keys=True),
            "the plan": plan.to_json() if isinstance(plan, Plan) else str(plan)}


def built_on_meta(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is on the meta device (each rank decides from its own free memory
    where it builds: a group's ranks must agree, for they start from one model each way)."""
    return any(p.is_meta for p in model.parameters())
