"""``tiertrain.setup``: the one call that puts a model's training state in tiers.

It returns the user's model itself, tiered in place, and a ``torch.optim.Optimizer`` that a plain
loop drives unchanged, schedulers and ``torch.nn.utils.clip_grad_norm_`` included::

    model, opt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True))
    loss = model(x, y); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); scheduler.step(); opt.zero_grad()

Without budgets it takes them from the machine (and says what it took); without a plan it plans
one (``auto``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from tiertrain.api.machine_budgets import machine_budgets
from tiertrain.autoplan.first_step import FIRST_PLAN, FirstStepAuto, first_plan, first_step_auto
from tiertrain.measure.disk_depth import STATE_BYTES, DiskIO, disk_io_for
from tiertrain.measure.page_size import CANDIDATES, page_size_for
from tiertrain.api.tiered_module import TieredModule, tiered_in_place
from tiertrain.api.tiered_optimizer import TieredOptimizer
from tiertrain.api.torch_clip import install_clip_redirect, tag
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, MemorySystem
from tiertrain.memory.capacity import check_budgets
from tiertrain.memory.heap import release_free_heap
from tiertrain.memory.system import compute_device
from tiertrain.optim.hparams import KEYS
from tiertrain.parallel import Collectives, world_from_env
from tiertrain.parallel.experts import expert_layers_for
from tiertrain.plan import (DEFAULT_MAX_STALENESS, ParallelLayout, Plan, RunOptions, check_update_mode, data_parallel,
                            load_plan)
from tiertrain.plan.fit import PlanDoesNotFit, page_for_states, resolve
from tiertrain.runtime.blocks import block_numel, block_sizes, find_blocks
from tiertrain.runtime.build import LetGo
from tiertrain.runtime.modes import mode_of
from tiertrain.runtime.runtime import Runtime

MAX_PAGE = CANDIDATES[-1]

if TYPE_CHECKING:
    from tiertrain.autoplan.auto_plan import AutoPlan

def optimizer_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[list[dict[str, Any]], dict[int, int]]:
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ConfigError(f"tiertrain runs AdamW; got {type(optimizer).__name__}. Pass torch.optim.AdamW(...)")
    if optimizer.state:
        raise ConfigError("pass a fresh AdamW (no steps taken yet); resume through tiertrain's checkpoints instead")
    groups, group_of = [], {}
    for g, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad") or group.get("maximize"):
            raise ConfigError("amsgrad and maximize are not supported by tiertrain's AdamW yet")
        groups.append({k: group[k] for k in KEYS})
        for p in group["params"]:
            group_of[id(p)] = g
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ConfigError(f"the optimizer does not hold parameter(s) {missing[:3]}; build it over model.parameters()")
    return groups, group_of


def setup(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, memory: Budgets | None = None,
          plan: "str | Plan" = "auto", options: RunOptions | None = None, *,
          profile_step: Callable[[], None] | None = None, collectives: Collectives | None = None,
          **fields: Any) -> tuple[nn.Module, TieredOptimizer | None]:
    """Place ``model``'s training state in the tiers ``memory`` allows, as ``plan`` says; return the
    model itself (changed in place) and the optimizer the loop steps.

    ``options`` (or its fields as keywords: ``grad_accum``, ``max_grad_norm``, ``update``, ...) are the
    run's settings (``RunOptions``): ``grad_accum`` and ``max_grad_norm`` tell the ``overlap`` mode when
    a block's gradients are final and whether to wait for the global norm before updating; a
    declared ``max_grad_norm`` clips every step in every mode that can clip.
    ``memory=None`` takes the budgets from the machine (``engine.machine_budgets``) and prints them.
    A plan that cannot fit the budgets is refused here, before anything is allocated.
    ``train=False`` streams the blocks for forward only (a teacher larger than the device,
    STRONGHOLD's distillation case): no optimizer states, no gradients; pass ``optimizer=None``.
    ``plan="auto"`` profiles the model with ``profile_step`` (one forward+backward at the training
    batch shape; cached per machine, model and shape) and takes the planner's best plan; without one,
    the loop's own first step is the profile: it runs under ``max-offload``, and the plan chosen from
    it takes over at the end of that step (``engine.first_step_auto``).
    ``init_states=False`` (resuming: a checkpoint is loaded right after) allocates the states where
    they live without writing the model's weights into them: a model built on the meta device is not
    initialised, and disk-homed states are written once, by the checkpoint, instead of twice.
    ``collectives``: the ranks the states are laid out over where they are not every rank of the run (a
    pipeline stage's data-parallel group: ``tiertrain.pipeline`` makes them); None: the run's process group.
    """
    opts = run_options(options, fields)
    _check_model(model, optimizer, opts)
    device = compute_device()
    if memory is None:
        taken = machine_budgets(device)
        print(f"tiertrain: {taken.describe()}", file=sys.stderr)
        memory = taken.budgets
    memory.check_disk_dir()
    # before anything is profiled, measured or reserved; the model's weights in RAM, which setup frees
    # block by block as they move into the pools, count as room
    check_budgets(memory, device, freed=weights_in_ram(model))
    groups, group_of = optimizer_groups(optimizer, model) if opts.train else ([], {})
    found = find_blocks(model, opts.blocks)
    expert_layers_for(model, opts.ep or 1)  # a dense model is refused before anything is laid out
    world = collectives.world_size if collectives is not None else world_from_env()
    if isinstance(plan, str) and plan == "auto" and opts.fixed_lag:
        raise ConfigError("plan 'auto' does not plan a fixed lag (its master a step ahead of its params) yet: give "
                          "a named plan or a plan file with fixed_lag, or leave fixed_lag out")
    if isinstance(plan, str) and plan == "auto" and profile_step is None:
        _check_first_step_auto(opts, world)  # before anything is measured
    numels = [block_numel(b) for b in found]
    page = page_size_for(opts.page_size, memory.disk_dir if memory.disk else None, device,
                         largest=page_for_states(numels, MAX_PAGE))
    if opts.page_size is None:  # a measured size: no larger than small models' chunks allow
        page = page_for_states(numels, page)
    # measured once, where it is needed first
    disk_io = functools.cache(lambda: _disk_io(opts, memory, page, STATE_BYTES * sum(numels)))
    chosen, auto, first = _planned(plan, model, found, memory, page, opts, device, profile_step, disk_io, world)
    io = disk_io()
    mem = MemorySystem(memory, page_size=page, check_machine=False, io_workers=io.depth, write_share=io.write_share,
                       device_reserve=_device_reserve(chosen, first))
    watched = found[0].module
    del found  # the blocks' lists held the model's original parameters: let them go block by block
    runtime = Runtime(model, groups, group_of, mem, chosen, opts, collectives,
                      let_go=_swapper(optimizer) if optimizer is not None else None)
    if first is not None:
        first.watch(watched)
    _closed_at_exit(runtime)
    return _tiered(model, optimizer, runtime, device, auto, first, opts)


def _closed_at_exit(runtime: Runtime) -> None:
    """A script that never closes its run (most do not) has it closed as the interpreter exits: its
    updates landed, its workers stopped, its disk files removed. Left to the interpreter, a worker still
    alive at its exit aborted the process now and then ("terminate called without an active exception",
    exit 134), and the disk tier's files stayed until the next run in that directory removed them."""
    ref = weakref.ref(runtime)

    def close() -> None:
        rt = ref()
        if rt is not None:
            rt.close()
            rt.mem.close()
    atexit.register(close)


def _device_reserve(plan: Plan, first: FirstStepAuto | None) -> int | None:
    """What the device pool maps: what the plan counts (on a GPU torch allocates activations beside the
    pool, and the planner counted them in the same budget), except in a first-step auto run, which
    replans into a plan not known yet and keeps the whole budget (None)."""
    return plan.resolved.device if first is None else None


def _check_model(model: nn.Module, optimizer: torch.optim.Optimizer | None, opts: RunOptions) -> None:
    if isinstance(model, TieredModule):
        raise ConfigError("this model was already set up by tiertrain; call tiertrain.setup once per model")
    if next(model.parameters()).dtype != torch.float32:
        raise ConfigError("tiertrain keeps an fp32 model; build it in fp32 (mixed precision comes from the plan)")
    if opts.train and optimizer is None:
        raise ConfigError("training needs an optimizer: pass torch.optim.AdamW(model.parameters(), ...)")


def _planned(plan: "str | Plan", model: nn.Module, found: list, memory: Budgets, page: int, opts: RunOptions,
             device: torch.device, profile_step: Callable[[], None] | None, disk_io: Callable[[], DiskIO],
             world: int) -> tuple[Plan, "AutoPlan | None", FirstStepAuto | None]:
    """The plan the run runs, resolved against the model's sizes, the budgets and the options
    (``plan.fit.resolve``); plan auto's choice (or, from the first step, what watches it). Any other
    plan is refused where it does not fit before the disk is measured."""
    auto, first = None, None
    if isinstance(plan, str) and plan == "auto":
        gain = disk_io().together_gain  # auto simulates the disk as the run will use it
        if profile_step is not None:
            auto = _auto(model, profile_step, memory, page, opts, gain, device)
            plan = auto.plan
        else:  # the first step is the profile
            first = first_step_auto(model, found, memory, page, opts, device, gain)
            plan = first_plan(len(found) - 1, memory.disk > 0, opts.update)
    chosen = _laid_out(_chosen(plan, found, memory, opts), opts, world)
    mode_of(chosen).check(chosen)  # what the update mode cannot run, refused before anything is allocated
    sizes = block_sizes(found, chosen.parallel.ep)
    try:
        resolved = resolve(chosen, sizes, memory, page, train=opts.train,
                           needs_all_grads=opts.needs_all_grads(chosen.compute_dtype))
        if resolved.reduce_on != chosen.reduce_on and int(os.environ.get("RANK", "0")) == 0:
            print("tiertrain: gradients reduced in host memory over the CPU group: the device budget cannot also hold "
                  "two blocks' fp32 gradients for on-device reduction (raise --device-memory to reduce there)",
                  file=sys.stderr)
        return resolved, auto, first
    except PlanDoesNotFit as exc:
        if first is None:
            raise
        raise PlanDoesNotFit(f"plan 'auto' runs its first step under {FIRST_PLAN!r}, the most frugal plan, and "
                             f"even it does not fit: {exc}") from None


def _tiered(model: nn.Module, optimizer: torch.optim.Optimizer | None, runtime: Runtime, device: torch.device,
            auto: "AutoPlan | None", first: FirstStepAuto | None, opts: RunOptions
            ) -> tuple[nn.Module, TieredOptimizer | None]:
    """The model tiered in place and the optimizer its loop drives, once the runtime is built."""
    _buffers_to(model, device)
    release_free_heap()  # profiling and building freed whole-block buffers: give them back to the OS
    runtime.replaced = {}  # by the ids of originals, some freed already: nothing may look them up now
    if runtime.dropped and optimizer is not None:  # expert parallel: the other ranks' experts are theirs
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in runtime.dropped]
    tag((p for g in runtime.groups for p in g.params), runtime)
    install_clip_redirect()
    tiered = tiered_in_place(model, runtime, auto)
    after = None if first is None else _replanned_after_step(first, runtime, tiered)
    topt = TieredOptimizer(runtime, optimizer, after) if opts.train else None
    return tiered, topt


def weights_in_ram(model: nn.Module) -> int:
    """Bytes of the model's parameters held in host memory (each storage once): setup moves them into the
    pools block by block and lets each block's originals go, so this much of the host comes back."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
                if p.device.type == "cpu" and not p.is_meta}
    return sum(storages.values())


def _swapper(optimizer: torch.optim.Optimizer) -> LetGo:
    """Swaps each of the user's optimizer's parameters for the one standing for it as its block is
    built: the optimizer held every original to the end of setup, so a model built in memory peaked
    at its whole fp32 weights beside the pools already filled (354M, 2.5 GiB of budgets: 3.27 GiB of
    RSS in setup). Positions are found by id while every original is alive, each looked up once,
    while its parameter still is. A build that fails part way leaves the optimizer partly swapped, as
    it leaves the model partly installed: set both up again."""
    where: dict[int, list[tuple[list, int]]] = {}
    for group in optimizer.param_groups:
        for k, p in enumerate(group["params"]):
            where.setdefault(id(p), []).append((group["params"], k))

    def swap(original: nn.Parameter, new: nn.Parameter) -> None:
        for params, k in where.pop(id(original), []):
            params[k] = new
    return swap


def _disk_io(opts: RunOptions, memory: Budgets, page: int, states_bytes: int) -> DiskIO:
    return disk_io_for(opts.page_size is None, memory.disk_dir if memory.disk else None, page, states_bytes)


def _check_first_step_auto(opts: RunOptions, world: int) -> None:
    """``plan="auto"`` with no profile function plans from the run's first step: a training run's, in one process."""
    if not opts.train:
        raise ConfigError("plan 'auto' takes a forward-only run's plan from a profile: pass profile_step=fn (one "
                          "forward at the batch shape), or a plan: 'stream' or 'max-offload'")
    if world > 1:
        raise ConfigError("plan 'auto' over several ranks needs a profile function, so that every rank plans alike: "
                          "pass profile_step=fn (one forward+backward at the batch shape), or a plan ('max-offload', "
                          "or a file from `tiertrain plan`)")


def _replanned_after_step(first: FirstStepAuto, runtime: Runtime, tiered: nn.Module) -> Callable[[], bool]:
    """Called after each optimizer step until it says it is done: the first step that ran a training
    forward re-plans the run (and the model's ``auto_plan`` says what was chosen)."""
    def after() -> bool:
        if first.tokens is None:
            return False
        tiered.auto_plan = first.after_step(runtime, tiered)
        return True

    return after


def run_options(options: RunOptions | None, fields: dict[str, Any]) -> RunOptions:
    """``options``, with any of its fields given as keywords in place (one typed object either way)."""
    from tiertrain import typed

    base = dataclasses.asdict(options) if options is not None else {}
    return typed.load(RunOptions, {**base, **fields}, "tiertrain.setup option")


def _laid_out(plan: Plan, opts: RunOptions, world: int) -> Plan:
    """The plan over the ``world`` ranks this model's states are laid out over (torchrun's, the user's
    process group, or a pipeline stage's data-parallel group): a
    plan for one process is laid out over all of them, sharded unless ``opts.shard`` is False (it is
    never trained as one independent model per rank); a plan made for another number of ranks is
    refused. ``opts.ep`` (expert parallel) and ``opts.shard_group`` (hybrid sharding) override the plan's."""
    ep = opts.ep or plan.parallel.ep
    group = opts.shard_group or plan.parallel.shard_group
    ranks = world_from_env()  # more than ``world`` where a tensor-parallel group or a pipeline holds one model
    one = "has one process" if ranks == 1 else (f"has one data-parallel replica (its {ranks} ranks are a tensor-"
                                                "parallel group or a pipeline holding one model)")
    if ep > 1 and world == 1:
        raise ConfigError(f"expert parallel ep={ep} divides the experts over {ep} data-parallel ranks, but this run "
                          f"{one}: launch it on {ep} times the ranks (tiertrain train --nproc ...), or use ep=1 (--ep 1)")
    if group and (world == 1 or opts.shard is False):
        raise ConfigError(f"hybrid sharding (shard_group={group}) splits sharded blocks over groups of ranks, but this "
                          f"run {one if world == 1 else 'replicates every block (shard=False)'}: launch "
                          "it on more ranks with sharded blocks, or leave shard_group (--shard-group) out and remove "
                          "it from the plan's \"parallel\" field")
    if plan.parallel.dp == world:
        layout = ParallelLayout(world, ep, group)
        return plan if plan.parallel == layout else dataclasses.replace(plan, parallel=layout)
    if plan.parallel.dp != 1:
        raise ConfigError(f"the plan is laid out for {plan.parallel.dp} ranks but this run has {world}: run it on "
                          f"{plan.parallel.dp} ranks, make it for {world} (tiertrain plan --nproc {world} ...), or "
                          "remove its \"parallel\" field (tiertrain then lays the plan out over the ranks)")
    shard = opts.shard is not False
    laid = data_parallel(plan, world, shard=shard, ep=ep, shard_group=group)
    if int(os.environ.get("RANK", "0")) == 0:
        experts = f"; each MoE layer's experts divided over {ep} ranks" if ep > 1 else ""
        how = "every block's states and gradients sharded" if shard else "every block replicated on each rank (DDP)"
        if laid.parallel.hybrid:
            how += (f" over groups of {group} ranks and replicated across the {world // group} groups (hybrid: only "
                    "the shards' all-reduces cross between groups)")
        print(f"tiertrain: data parallel over {world} ranks, {how}{experts}", file=sys.stderr)
    return laid


def _chosen(plan: "str | Plan", found: list, memory: Budgets, opts: RunOptions) -> Plan:
    """The plan asked for, with the run's overrides (update mode, staleness, compute dtype), checked."""
    n = len(found) - 1
    chosen = load_plan(plan, n, disk=memory.disk > 0, update=opts.update)
    given = {"max_staleness": opts.max_staleness, "fixed_lag": opts.fixed_lag, "compute_dtype": opts.compute_dtype}
    given = {k: v for k, v in given.items() if v is not None}
    if given:  # together, then checked once: one override may make another's check pass
        chosen = dataclasses.replace(chosen, **given).validate(n)
    if opts.reduce_dtype is not None:
        chosen = dataclasses.replace(chosen, reduce_dtype=opts.reduce_dtype)
    if opts.reduce_every is not None:
        chosen = dataclasses.replace(chosen, reduce_every=opts.reduce_every)
    if chosen.reduce_every == "step" and chosen.reduce_dtype != "fp32":
        raise ConfigError(f"gradients reduced once a step are summed over the micro-batches in the reduce dtype first: "
                          f"{chosen.reduce_dtype} would round each micro-batch's; reduce in fp32, or every micro-batch")
    check_update_mode(chosen.update, chosen.compute_dtype, opts.grad_accum, opts.clips)
    if chosen.uses_disk and not memory.disk:
        raise ConfigError("this plan homes states on disk; give a disk budget: Budgets(..., disk=SIZE, disk_dir=DIR)")
    return chosen


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Buffers (masks, rotary tables) are no training state: they go to the compute device whole,
    where the parameters now sit in their slots, while the model object itself stays where it was built."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                module._buffers[name] = buf.to(device)


def _auto(model: nn.Module, step: Callable[[], None], memory: Budgets, page: int, opts: RunOptions,
          disk_gain: float, device: torch.device) -> AutoPlan:
    """Profile outside the run's random stream, so an auto run trains as the same plan from a file would.
    The run's update mode and clipping are refused before profiling, not after it. ``disk_gain``:
    how much faster the run's disk tier moves reads and writes at once than in turns (``DiskIO``)."""
    from tiertrain.autoplan.auto_plan import auto_plan

    precision, update = opts.compute_dtype or "fp32", opts.update or "sync"
    check_update_mode(update, precision, opts.grad_accum, opts.clips)
    # the run's GPU's stream too, even where the model still sits on the CPU: profiling runs it there
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        return auto_plan(model, step, memory, page, precision, update, opts.needs_all_grads(precision), opts.blocks,
                         max_staleness=DEFAULT_MAX_STALENESS if opts.max_staleness is None else opts.max_staleness,
                         disk_gain=disk_gain)
