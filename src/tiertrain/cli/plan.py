"""``tiertrain plan``: the chosen plan per block, its prediction, and the other solvers' distance; for
this machine or a described one (``--machine``), or the largest model a machine trains (``--max-model``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from tiertrain.errors import ConfigError
from tiertrain.plan import BlockPlan, Budgets
from tiertrain.plan.pipeline import PipelineLayout, fold
from tiertrain.planner.auto import Candidate, run_profile
from tiertrain.planner.machine import Machine
from tiertrain.planner.pipeline import (
    PipelineChoice,
    choose_pipeline,
    for_stage,
    predict,
)
from tiertrain.planner.profile import Profile, with_experts
from tiertrain.planner.simulator import RESOURCES, Simulation
from tiertrain.units import format_bytes, format_count

if TYPE_CHECKING:
    from torch import nn

    from tiertrain.autoplan.largest_model import Largest, RunShape
    from tiertrain.parallel.tensor_plans import TensorPlan
    from tiertrain.plan.fit import Sizes
    from tiertrain.planner.layouts import Layout
    from tiertrain.planner.network import Network


@dataclass(frozen=True)
class PlanRequest:
    """What ``tiertrain plan`` was asked, flags as given (sizes still text)."""

    model: str | None
    batch: int
    seq: int | None
    precision: str
    device_memory: str | None
    host_memory: str | None
    disk: str | None
    profile_file: str | None
    solvers: tuple[str, ...]
    levels: int | None
    page_size: str | None
    update: str
    max_staleness: int
    grad_clip: float
    grad_accum: int
    machine: str | None
    max_model: bool
    measure_memory: str | None
    measure_seconds: float | None
    nproc: int = 1                     # data-parallel ranks planned for, each with these budgets
    nproc_per_node: int = 0            # ranks per node (0: all on one); fewer than nproc: plan over nodes
    ep: int = 1                        # expert parallel: ranks a mixture-of-experts layer's experts are divided over
    pp: int = 1                        # pipeline stages: the nproc ranks as nproc / pp replicas of a pipeline
    schedule: str | None = None        # with pp: the pipeline's schedule where it is given, not chosen (and its
    segments: int = 1                  # segments; grad_accum micro-batches splitting batch)
    tp: int = 1                        # tensor parallel: each block cut over groups of tp ranks inside a node
    sequence_parallel: bool = False    # with tp: the sequence sliced over the group between its cut regions

    @property
    def layout(self) -> PipelineLayout | None:
        """The pipeline's layout where it is given (``--schedule``), else None: FOLD3D's model chooses one."""
        if self.pp == 1 or self.schedule is None:
            return None
        return PipelineLayout(self.pp, self.schedule, self.grad_accum, self.segments)

    @property
    def needs_all_grads(self) -> bool:
        from tiertrain.plan import RunOptions

        return RunOptions(grad_accum=self.grad_accum, max_grad_norm=self.grad_clip or None).needs_all_grads(self.precision)


def _disk_dir(req: PlanRequest) -> str | None:
    return Budgets.parse(0, 0, req.disk).disk_dir if req.disk else None


def sizes_for(req: PlanRequest, target: Machine | None) -> tuple[Budgets, str | None]:
    """The budgets (given, else the described machine's) and the disk directory, if one was given."""
    from tiertrain.units import parse_size

    disk_dir, disk = _disk_dir(req), None
    if req.disk and ":" in req.disk:
        disk = Budgets.parse(0, 0, req.disk).disk
    described = target.budgets() if target else None
    if described is None and not (req.device_memory and req.host_memory):
        raise ConfigError("give --device-memory and --host-memory, or --machine NAME|FILE to plan for a described "
                          "machine's memory (tiertrain probe --list names the built-in ones)")

    def size(given: str | None, default: int) -> int:
        return parse_size(given) if given else default

    sizes = Budgets(size(req.device_memory, described.device if described else 0),
                    size(req.host_memory, described.host if described else 0),
                    disk if disk is not None else (described.disk if described else 0))
    return sizes, disk_dir


def _home(bp: BlockPlan) -> str:
    """Where a block's states live: its home, and a disk-homed one's master kept on the host, or its
    update cut into pieces."""
    notes = (["master host"] if bp.host_master else []) + ([f"pieces {format_bytes(bp.piece)}"] if bp.piece else [])
    return bp.home.value + (f" ({', '.join(notes)})" if notes else "")


def print_plan(chosen: Candidate, cands: list[Candidate], profile: Profile, console: Console,
               matmul_flops: float = 0.0) -> None:
    """The plan, its prediction beside what its compute alone takes (``matmul_flops``: the machine's rate
    in the plan's precision), and every solver's."""
    plan, sim = chosen.plan, chosen.sim
    table = Table(title=f"plan {plan.name}: window {plan.window}, cache {plan.cache}, prefetch {plan.prefetch}, "
                        f"update {plan.update}")
    dp = plan.parallel.dp
    for col in ("block", "home", "stream", "recompute", "offload_hidden", *(("shard",) if dp > 1 else ())):
        table.add_column(col)
    for b, bp in zip(profile.blocks, plan.blocks):
        table.add_row(b.name, _home(bp), _yes(bp.stream), _yes(bp.recompute), _yes(bp.offload_hidden),
                      *((_yes(bp.shard),) if dp > 1 else ()))
    console.print(table)
    if profile.source:
        console.print(f"profile: {profile.source}")
    console.print(f"predicted step {sim.step_s * 1e3:.1f} ms; bottleneck {sim.bottleneck}; peaks "
                  + ", ".join(f"{t} {format_bytes(v)}" for t, v in sim.peaks.items()))
    for line in explain_step(sim.step_s, profile, matmul_flops):
        console.print(line)
    if dp > 1:
        net, group = sim.timeline.busy("net"), plan.parallel.shard_group
        every = (*plan.blocks, plan.rest)
        split = sum(b.shard for b in every)
        over = (f"each node's {group} ranks, replicated across the {dp // group} nodes (hybrid)" if plan.parallel.hybrid
                else f"{dp} ranks")
        how = (f"states sharded over {over}" if split == len(every) else f"states replicated on {dp} ranks"
               if not split else f"{split} of {len(every)} blocks' states sharded over {over}, the others replicated")
        console.print(f"per rank: collectives {net * 1e3:.1f} ms a step on the network ({how})")
    for c in cands:
        name = c.plan.name.removeprefix("auto/") if c.plan is not None else c.solver
        if c.sim is None:
            console.print(f"  {name:24s} found no plan that fits")
        else:
            console.print(f"  {name:24s} {c.sim.step_s * 1e3:9.1f} ms  (+{(c.sim.step_s / sim.step_s - 1) * 100:.1f}%)")


def explain_step(step_s: float, p: Profile, matmul_flops: float) -> list[str]:
    """What a predicted step stands against: the blocks' matrix products and attention alone at the
    machine's matrix-product rate (the rough 6 x params x tokens / FLOP/s estimate, from the blocks' own
    work), and a profile measured while other processes took cores (it reads every block slow)."""
    out = []
    if p.step_flops and matmul_flops:
        alone = p.step_flops / matmul_flops
        out.append(f"compute alone: {p.step_flops / 1e12:.2f} TFLOP a step (matrix products and attention, "
                   f"backward twice forward) at {matmul_flops / 1e9:.0f} GFLOP/s is {alone * 1e3:.1f} ms; the "
                   f"predicted step is {step_s / alone:.2f}x that (recompute, element-wise traffic, and copies, "
                   "the optimizer and the disk where they do not overlap it)")
    if p.busy:
        out.append(f"the profile was measured while other processes took {p.busy:.1f} cores: every block reads slow "
                   "by about as much as they took (it is used once, not cached); plan again on a quiet machine")
    return out


def print_largest(found: Largest, machine: Machine, console: Console) -> None:
    """``--max-model``'s answer beside the capacity bound."""
    cfg, sim, sizes = found.cfg, found.chosen.sim, found.sizes
    ranks = found.run.ranks
    each = f" a rank, {ranks} ranks" if ranks > 1 else ""
    console.print(f"machine {machine.name}: device {format_bytes(sizes.device)}, host {format_bytes(sizes.host)}, "
                  f"disk {format_bytes(sizes.disk)}{each} ({machine.source or 'described'})")
    if found.run.cluster is not None:
        c = found.run.cluster
        console.print(f"layout: --nproc {ranks} --tp {c.tp}: each block cut over {c.tp} ranks of a node, its shards' "
                      f"states split over their {c.network.dp} replicas ({c.network.source})")
    console.print(f"largest GPT-3-shaped model that fits: {cfg.n_layer} blocks x width {cfg.d_model} "
                  f"({format_count(found.params)} params; the family's largest at 128 x depth: "
                  f"{found.family.n_layer} x {found.family.d_model})")
    console.print(f"capacity bound (device + host + disk){' x ranks' if ranks > 1 else ''} / 16 B per param: "
                  f"{format_count(found.bound_params)} params; "
                  f"the answer is {found.params / max(found.bound_params, 1) * 100:.0f}% of it")
    streamed = sum(b.stream for b in found.chosen.plan.blocks)
    homes = {t: sum(b.home.value == t for b in found.chosen.plan.blocks) for t in ("device", "host", "disk")}
    console.print(f"plan {found.chosen.plan.name}: {streamed}/{cfg.n_layer} blocks streamed, states on "
                  + ", ".join(f"{t} {n}" for t, n in homes.items() if n)
                  + f"; predicted step {sim.step_s:.2f} s, bottleneck {sim.bottleneck}; peaks "
                  + ", ".join(f"{t} {format_bytes(v)}" for t, v in sim.peaks.items()))


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def write_png(sim: Simulation, path: Path) -> None:
    """Resource timelines above, the memory of each tier over the step below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("writing a PNG needs matplotlib: pip install 'tiertrain[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for row, res in enumerate(RESOURCES):
        spans = [(s, e - s) for r, s, e, _ in sim.timeline.tasks if r == res]
        top.broken_barh(spans, (row - 0.4, 0.8))
    top.set_yticks(range(len(RESOURCES)), RESOURCES)
    top.set_title(f"predicted step {sim.step_s * 1e3:.1f} ms, bottleneck {sim.bottleneck}")
    for tier in ("device", "host", "disk"):
        pts = sorted((t, v) for t, k, v in sim.memory if k == tier)
        if pts:
            bottom.step([t for t, _ in pts], [v / 2**20 for _, v in pts], where="post", label=tier)
    bottom.set_ylabel("MiB in use")
    bottom.set_xlabel("seconds into the step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plan_profile(req: PlanRequest, here: Machine, target: Machine, disk_dir: str | None) -> Profile:
    """The profile to plan from, as it would run on ``target``: a profile file, or the model measured
    here within the measurement bounds (``engine.auto_plan.config_profile``), carried to ``target``
    by its rates (nothing changes where ``target`` is this machine)."""
    from tiertrain.planner.retarget import for_machine

    if req.profile_file:
        profile = Profile.load(Path(req.profile_file))  # taken as measured here
    elif req.model:
        profile = _model_profile(req, here, disk_dir)
    else:
        raise ConfigError("give --model NAME or --profile FILE (or --max-model)")
    return for_machine(profile, here, target)


def _model_profile(req: PlanRequest, here: Machine, disk_dir: str | None) -> Profile:
    from tiertrain.autoplan.auto_plan import config_profile
    from tiertrain.measure.bounds import MeasureBounds
    from tiertrain.memory.system import compute_device
    from tiertrain.models import ModelConfig, resolve_config
    from tiertrain.units import parse_size

    cfg = resolve_config(req.model)
    longest = cfg.max_seq_len if isinstance(cfg, ModelConfig) else getattr(cfg, "max_position_embeddings", None)
    if not (req.seq or longest):
        raise ConfigError(f"give --seq: the config of {req.model!r} names no maximum sequence length")
    bounds = MeasureBounds.default(compute_device())
    if req.measure_memory is not None or req.measure_seconds is not None:
        bounds = dataclasses.replace(bounds, memory=parse_size(req.measure_memory) if req.measure_memory else bounds.memory,
                                     seconds=bounds.seconds if req.measure_seconds is None else req.measure_seconds)
    return config_profile(cfg, req.batch, req.seq or longest, req.precision, disk_dir, bounds=bounds, here=here)


def _check_experts(req: PlanRequest) -> Sizes:
    """What each block of the model holds on one rank at ``req.ep`` (``held_experts``), once the layout
    and the model are checked."""
    from tiertrain.plan import ParallelLayout

    if req.nproc == 1 or not req.model:
        raise ConfigError(f"--ep {req.ep} divides a mixture of experts' experts over ranks: plan a --model over "
                          f"--nproc N ranks (N a multiple of {req.ep})")
    ParallelLayout(dp=req.nproc // (req.tp * req.pp), ep=req.ep)  # one message where ep does not divide the replicas
    return held_experts(req)


def held_experts(req: PlanRequest) -> Sizes:
    """What each block of ``req``'s model holds on one rank at ``req.ep`` (the model built on the meta
    device: no memory; under ``--tp``, its rank's shards), with the run's own count
    (``runtime.blocks.block_sizes``)."""
    import torch

    from tiertrain.models import build, resolve_config
    from tiertrain.parallel.experts import expert_layers_for
    from tiertrain.parallel.tensor_plans import check_tensor_parallel, cut_on_meta
    from tiertrain.runtime.blocks import block_sizes, find_blocks

    with torch.device("meta"):
        model = build(resolve_config(req.model))
    layers = expert_layers_for(model, req.ep)
    if any(m.n_experts % req.ep for m in layers):
        raise ConfigError(f"--ep {req.ep} does not divide the model's {layers[0].n_experts} experts")
    if req.tp > 1:
        cut_on_meta(model, check_tensor_parallel(model, req.tp), req.tp)
    return block_sizes(find_blocks(model, None), req.ep)


@dataclass(frozen=True)
class Planned:
    """A plan chosen, and the step it predicts for the whole layout (a pipeline's: FOLD3D's model's)."""

    chosen: Candidate
    step_s: float


def run_plan(req: PlanRequest, console: Console) -> Planned:
    """Plan ``req``'s model (or profile) for ``req.machine`` (default: this one); print it; return the choice."""
    from tiertrain.measure.machine import probe
    from tiertrain.plan import check_update_mode
    from tiertrain.planner.auto import choose_layout, run_profile
    from tiertrain.planner.datasheets import find_machine
    from tiertrain.planner.solvers import SOLVERS, Problem

    check_update_mode(req.update, req.precision, req.grad_accum, req.grad_clip > 0)
    target = find_machine(req.machine) if req.machine else None
    if target is not None:
        target.matmul(req.precision)  # a machine without this precision is refused before anything is measured
    _check_tensor(req)
    _check_pipeline(req)
    held = _check_experts(req) if req.ep > 1 else None  # refused before anything is measured too
    if 0 < req.nproc_per_node < req.nproc:  # over nodes: refused before anything is measured too
        from tiertrain.measure.collectives import network_for

        network_for(req.nproc, target.network if target is not None else None, req.machine or "", 0,
                    req.nproc_per_node)
    sizes, disk_dir = sizes_for(req, target)
    here = probe(disk_dir)
    target = target or here
    profile = plan_profile(req, here, target, disk_dir)
    profile = dataclasses.replace(profile, page=_page(req, profile, target, disk_dir))
    profile = dataclasses.replace(profile, machine=dataclasses.replace(
        profile.machine, disk_together_gain=_disk_gain(req, profile, here, target, disk_dir)))
    profile = run_profile(profile, req.update, req.max_staleness, req.needs_all_grads, group=req.tp > 1)
    tensor_line, tp = None, req.tp
    if req.tp > 1:  # the data-parallel ranks are a group's replicas: each holds its rank's share of every block
        profile, tensor_line = _cut_over_group(req, profile, target, here, held)
        per_node = req.nproc_per_node // req.tp if req.nproc_per_node else 0
        req = dataclasses.replace(req, nproc=req.nproc // req.tp, nproc_per_node=per_node)
    if req.pp > 1:  # the data-parallel ranks are a stage's replicas: those of one node hold the same stage
        per_node = max(1, req.nproc_per_node // req.pp) if req.nproc_per_node else 0
        req = dataclasses.replace(req, nproc=req.nproc // req.pp, nproc_per_node=per_node)
    if req.nproc > 1:
        profile = dataclasses.replace(profile, network=dataclasses.replace(_network(req, target, here, profile),
                                                                           ep=req.ep, staged=req.pp > 1))
    if req.ep > 1 and req.tp == 1:  # (cut over a group: counted with the rank's shards)
        profile = with_experts(profile, held)
    needs_all, pipeline = req.needs_all_grads, None
    if req.pp > 1:  # the layout first: a rank plans the largest of its stages within its share of the budgets
        bps = _pp_bps(target, here, profile)
        pipeline = ([predict(profile, req.layout, profile.network, bps, req.batch)] if req.layout is not None
                    else choose_pipeline(profile, req.pp, profile.network, bps, req.batch))
        profile, sizes, needs_all = one_stage(profile, sizes, pipeline[0].layout, req)
    pb = Problem.sized(profile, sizes, req.levels)
    chosen, cands = choose_layout(pb, req.solvers or tuple(SOLVERS), req.update, needs_all, req.max_staleness)
    if tensor_line is not None and chosen.plan is not None:  # the file says how the run is cut, and train refuses another cut (check_run)
        chosen = dataclasses.replace(chosen, plan=dataclasses.replace(chosen.plan, parallel=dataclasses.replace(
            chosen.plan.parallel, tp=tp, sequence_parallel=req.sequence_parallel)))
    if target is not here:
        console.print(f"planned for {target.name} ({target.source or 'described'})")
    if req.nproc > 1:
        console.print(f"{req.nproc} ranks, each with these budgets; network: {profile.network.source}")
    print_plan(chosen, cands, profile, console, target.matmul(req.precision))
    if tensor_line is not None:
        console.print(tensor_line)
    if pipeline is not None:
        print_pipeline(pipeline, req.batch, console)
        _say_if_once_a_step_overflows(chosen, profile, sizes, needs_all, console)
    # a pipeline's step: FOLD3D's (its stages' compute, bubble and syncs), or where longer its stage's
    # simulated step with the tiers' traffic, which FOLD3D's model leaves out: a bound, not a sum
    return Planned(chosen, max(pipeline[0].step_s, chosen.sim.step_s) if pipeline is not None else chosen.sim.step_s)


def run_layouts(req: PlanRequest, console: Console) -> Planned:
    """Plan every dp x pp x tp layout of ``req.nproc`` ranks (``planner.layouts``), print their predicted
    steps and throughput side by side, then the fastest's plan in full; return it."""
    from tiertrain.models import config_blocks, resolve_config
    from tiertrain.planner.layouts import layouts

    if req.nproc == 1 or not req.model or req.tp > 1 or req.pp > 1 or req.schedule or req.ep > 1:
        raise ConfigError("--layouts compares the layouts of --nproc N ranks (N > 1) for a --model: give both, and "
                          "leave out --tp, --pp, --schedule and --ep (it chooses them)")
    cfg = resolve_config(req.model)
    seq = req.seq or getattr(cfg, "max_seq_len", 0) or 1
    table = Table(title=f"{req.nproc} ranks: each layout planned in full (a replica takes {req.batch} sequences "
                        "a step: a step's --batch, as the planner predicts it)")
    for col in ("layout", "replicas", "predicted step", "tokens/s", "why not"):
        table.add_column(col)
    found = []
    for lay in layouts(req.nproc, req.nproc_per_node, config_blocks(cfg) or 1, lambda tp: _cuts(req.model, tp)):
        row = _plan_layout(req, lay, seq, console.width)
        if isinstance(row, str):
            table.add_row(lay.flags(), str(lay.dp), "-", "-", row[:80])
            continue
        found.append(row)
        table.add_row(lay.flags(), str(lay.dp), f"{row[2].step_s * 1e3:.4g} ms", f"{row[0]:,.0f}", "")
    console.print(table)
    if not found:
        raise ConfigError(f"no layout of {req.nproc} ranks fits this model in these budgets: give the ranks more "
                          "memory (--device-memory, --host-memory, --disk) or more ranks")
    speed, lay, best, text = max(found, key=lambda f: f[0])
    console.print(text, end="", markup=False, highlight=False)  # the fastest layout's plan, as plan prints one
    sliced = " --sequence-parallel" if req.sequence_parallel else ""
    console.print(f"fastest layout: --nproc {req.nproc} {lay.flags()}{sliced} ({lay.dp} replicas), {speed:,.0f} tokens/s "
                  "predicted; the plan above is for one of its ranks: train it with these flags and --plan FILE")
    return best


def _plan_layout(req: PlanRequest, lay: Layout, seq: int, width: int) -> tuple[float, Layout, Planned, str] | str:
    """``lay`` planned in full, quietly: its tokens a second, itself, its plan and what plan printed of it;
    or why it cannot be planned."""
    import io

    from tiertrain.errors import one_line
    from tiertrain.planner.layouts import tokens_per_s

    quiet = Console(file=io.StringIO(), width=width, record=True)
    try:
        planned = run_plan(dataclasses.replace(req, tp=lay.tp, pp=lay.pp), quiet)
    except ConfigError as exc:
        return one_line(exc)
    return tokens_per_s(lay, req.batch, seq, planned.step_s), lay, planned, quiet.export_text()


def _cuts(model: str, tp: int) -> bool:
    """Whether tensor parallel can cut ``model`` into ``tp`` shards as plan --tp models it."""
    if tp == 1:
        return True
    try:
        _tensor_model(model, tp)
    except ConfigError:
        return False
    return True


def one_stage(profile: Profile, budgets: Budgets, layout: PipelineLayout, req: PlanRequest
              ) -> tuple[Profile, Budgets, bool]:
    """What a rank of ``layout`` plans: its largest stage's blocks (each of its ``segments`` stages runs the
    plan from its first block on: ``plan.pipeline.stage_plan``), within its share of the budgets
    (``api.pipeline`` gives each stage an equal one), every gradient of the step held where there are
    several micro-batches (they accumulate)."""
    runs = fold(len(profile.blocks), layout.pp, layout.segments)
    needs_all = req.needs_all_grads or layout.micro_batches > 1
    staged = run_profile(for_stage(profile, layout, max(map(len, runs))), req.update, req.max_staleness, needs_all,
                         group=req.tp > 1)
    n = layout.segments
    return staged, Budgets(budgets.device // n, budgets.host // n, budgets.disk // n, budgets.disk_dir), needs_all


def _say_if_once_a_step_overflows(chosen: Candidate, profile: Profile, budgets: Budgets, needs_all: bool,
                                  console: Console) -> None:
    """A pipeline reduces each stage's gradients once a step (``reduce_every="step"``), holding every block's
    stage through it, which the solvers do not count yet: say where the plan then exceeds the budgets."""
    from tiertrain.plan.fit import over_budgets

    over = over_budgets(profile.sizes(), dataclasses.replace(chosen.plan, reduce_every="step"), profile.page, budgets,
                        grads="all" if needs_all else "transient")
    for tier, nbytes in over.items():
        console.print(f"note: reduced once a step, as the pipeline reduces, this stage's plan needs "
                      f"{format_bytes(nbytes)} of {tier.value} memory, over its {format_bytes(budgets[tier])}: "
                      "the run will refuse it; give the stage more, or fewer segments")


def _check_pipeline(req: PlanRequest) -> None:
    """What a pipelined plan cannot be, refused before anything is measured."""
    if req.pp == 1:
        if req.schedule is not None:
            raise ConfigError("--schedule plans a pipeline's stages: add --pp P (and --nproc N)")
        return
    ranks = req.nproc // req.tp  # with --tp, each stage's blocks are cut over a group: a pipeline spans pp groups
    if ranks % req.pp:
        over = f" / --tp {req.tp}" if req.tp > 1 else ""
        raise ConfigError(f"--pp {req.pp} does not divide --nproc {req.nproc}{over}: the ranks form --nproc{over} / "
                          "--pp replicas of the pipeline")
    if req.layout is not None:
        from tiertrain.models import config_blocks, resolve_config

        blocks = config_blocks(resolve_config(req.model)) if req.model else None
        req.layout.check(ranks, blocks or req.layout.stages, req.batch)


def _pp_bps(target: Machine, here: Machine, profile: Profile) -> float:
    """The rate of a pipeline's sends between its stages (one node's ranks): the described machine's first
    link, else this machine's all-gather rate between two local ranks, measured."""
    return _node_link(target, here, profile, 2).all_gather_bps


def _node_link(target: Machine, here: Machine, profile: Profile, ranks: int) -> Network:
    """The collectives' rates between ``ranks`` ranks of one node at a block's output size: the described
    machine's first link, else measured here."""
    from tiertrain.measure.collectives import measure_network
    from tiertrain.planner.network import Network

    if target is not here and target.network:
        link = target.network[0]
        return Network.from_link(ranks, link.bps, f"{target.name}'s link {link.name}")
    return measure_network(ranks, max(b.hidden_bytes for b in profile.blocks) or 1 << 20)


def _check_tensor(req: PlanRequest) -> None:
    """What a tensor-parallel plan cannot be, refused before anything is measured."""
    if req.sequence_parallel and req.tp == 1:
        raise ConfigError("--sequence-parallel plans a tensor-parallel group's sequence slices: give --tp T (above "
                          "1)")
    if req.tp == 1:
        return
    from tiertrain.plan.update_modes import check_group_reads_alike

    check_group_reads_alike(req.update, req.max_staleness)
    if req.nproc % req.tp or (req.nproc_per_node and req.nproc_per_node % req.tp):
        raise ConfigError(f"--tp {req.tp} must divide --nproc {req.nproc}"
                          + (f" and --nproc-per-node {req.nproc_per_node} (a group stays inside a node)"
                             if req.nproc_per_node else ""))
    if not req.model or req.profile_file:
        raise ConfigError("--tp plans a model cut over ranks by its parallelize plan: give --model (a name or config "
                          "file), not --profile")
    built, cut = _tensor_model(req.model, req.tp, req.pp)
    if req.sequence_parallel:
        from tiertrain.parallel.tensor_plans import check_sequence_parallel

        check_sequence_parallel(built, cut)


def _tensor_model(model: str, tp: int, pp: int = 1) -> tuple[nn.Module, TensorPlan]:
    """``model`` built on the meta device and its tensor-parallel plan; refused in one line where the plan
    cannot cut it into ``tp`` (or, in ``pp`` stages, train would refuse the cut: a tied head)."""
    from tiertrain.models import build, resolve_config
    from tiertrain.parallel.tensor_plans import check_pipeline_tensor

    built = build(resolve_config(model), device="meta")
    return built, check_pipeline_tensor(built, tp, pp)


def _cut_over_group(req: PlanRequest, profile: Profile, target: Machine, here: Machine,
                    held: Sizes | None) -> tuple[Profile, str]:
    """One rank's profile of a tensor-parallel group (``planner.tensor``), and what the plan says of it;
    ``held``: under expert parallel, the shards of its experts and of the rest of each block it holds."""
    from tiertrain.models import ModelConfig
    from tiertrain.parallel.tensor_plans import summed_in_a_block, whole_in_a_block
    from tiertrain.planner.tensor import for_tensor, sums_s, with_stage_ends

    link = _node_link(target, here, profile, req.tp)
    built, plan = _tensor_model(req.model, req.tp)
    cfg = built.config
    routed = cfg.top_k if isinstance(cfg, ModelConfig) and cfg.is_moe else 1
    cut = for_tensor(profile, req.tp, link.all_reduce_bps, whole_in_a_block(built, plan), routed,
                     req.sequence_parallel, summed_in_a_block(built, plan))
    if req.sequence_parallel:  # a pipeline stage's ends: the whole sequence gathered there
        cut = with_stage_ends(cut, plan.length_before_blocks, plan.views_after_blocks, req.tp, link.all_reduce_bps)
    if held is not None:
        cut = with_experts(cut, held)
    compute = sum(b.forward_s + b.backward_s for b in cut.blocks)
    sums = sums_s(profile, cut, req.tp)
    sliced = ", each rank its slice of the sequence between them" if req.sequence_parallel else ""
    return cut, (f"tensor parallel: --tp {req.tp}{sliced}, each rank {cut.blocks[0].params:,} of a block's "
                 f"{profile.blocks[0].params:,} parameters; the group's sums {sums * 1e3:.1f} ms a step of its "
                 f"blocks' {compute * 1e3:.1f} ms, on the critical path ({link.source or 'measured here'})")


def print_pipeline(choices: list[PipelineChoice], rows: int, console: Console) -> None:
    """The chosen schedule, segments and micro-batches with FOLD3D's prediction and why, and the runners-up;
    ``rows``: the sequences of a replica's step (``train --pp`` takes ``--batch-size`` per micro-batch)."""
    best = choices[0]
    lay = best.layout
    where = "host" if lay.schedule == "aiao" else "device"
    console.print(f"pipeline: --pp {lay.pp} --schedule {lay.schedule} --segments {lay.segments} --micro-batches "
                  f"{lay.micro_batches} --batch-size {rows // lay.micro_batches}: predicted step "
                  f"{best.step_s * 1e3:.1f} ms (FOLD3D's model; --batch-size is a micro-batch's, {rows} a step)")
    console.print(f"  why: {best.why()}")
    console.print(f"  per rank: {best.params:,} parameters (each stage's tiers as the plan above); stash "
                  f"{best.stash} activation checkpoints, {format_bytes(best.stash_bytes)} in {where} memory")
    seen = {(lay.schedule, lay.segments, lay.micro_batches)}
    for c in choices[1:]:
        key = (c.layout.schedule, c.layout.segments)
        if key in {k[:2] for k in seen}:
            continue  # each schedule and segment count's best only
        seen.add((*key, c.layout.micro_batches))
        console.print(f"  {c.layout.schedule:12s} ns {c.layout.segments} M {c.layout.micro_batches:<3d} "
                      f"{c.step_s * 1e3:9.1f} ms  (+{(c.step_s / best.step_s - 1) * 100:.1f}%)")


def _disk_gain(req: PlanRequest, profile: Profile, here: Machine, target: Machine, disk_dir: str | None) -> float:
    """The disk's gain for reads and writes at once as the run will take it: as `tiertrain probe` describes
    it (at its page size), or the described machine's; none where the run measures no depth and keeps
    reads first (``measure.disk_depth.disk_io_for``): it names its page size, or its states are too small
    to be worth measuring."""
    from tiertrain.measure.disk_depth import STATE_BYTES, depth_worth_measuring
    from tiertrain.measure.machine import with_disk_gain

    params = sum(b.params for b in (*profile.blocks, profile.rest))
    if req.page_size or not depth_worth_measuring(STATE_BYTES * params):
        return 1.0
    return target.disk_together_gain if target is not here else with_disk_gain(here, disk_dir).disk_together_gain


def _network(req: PlanRequest, target: Machine, here: Machine, profile: Profile) -> Network:
    """The ranks' collective rates: measured between local ranks at the largest block's size where the
    plan is for this machine, else the described machine's link."""
    from tiertrain.measure.collectives import network_for

    chunk = max(b.params for b in profile.blocks) * profile.compute_bytes
    return network_for(req.nproc, None if target is here else target.network, target.name, chunk, req.nproc_per_node)


def _page(req: PlanRequest, profile: Profile, target: Machine, disk_dir: str | None) -> int:
    """The page size the run will use: as given, else the profile's, else the described machine's or
    the one measured here, as setup cuts it for the model's chunks (``plan.bytes.page_for_states``):
    chunks take whole pages, so the plan needs the run's."""
    from tiertrain.plan.fit import page_for_states
    from tiertrain.units import parse_size

    if req.page_size:
        from tiertrain.memory.pool import check_page_size

        return check_page_size(parse_size(req.page_size))
    if profile.page:
        return profile.page
    numels = [b.params for b in (*profile.blocks, profile.rest)]
    if target.page_size:
        return page_for_states(numels, target.page_size)
    from tiertrain.measure.page_size import page_size_for
    from tiertrain.memory.system import compute_device

    return page_for_states(numels, page_size_for(None, disk_dir, compute_device()))


def run_max_model(req: PlanRequest, console: Console) -> Largest:
    """``--max-model``: the largest GPT-3-shaped model for ``req.machine`` (default: this one, probed)."""
    from tiertrain.autoplan.largest_model import RunShape, largest_model
    from tiertrain.measure.machine import probe, with_disk_gain
    from tiertrain.plan import check_update_mode
    from tiertrain.planner.datasheets import find_machine
    from tiertrain.units import parse_size

    check_update_mode(req.update, req.precision, req.grad_accum, req.grad_clip > 0)
    if req.model or req.profile_file:
        raise ConfigError("--max-model searches the GPT-3 family itself; drop --model/--profile")
    if req.pp > 1 or req.ep > 1:
        raise ConfigError("--max-model lays a cluster out over tensor and data parallel: leave out --pp and --ep")
    _check_tensor_ranks(req)
    disk_dir = _disk_dir(req)
    target = find_machine(req.machine) if req.machine else with_disk_gain(probe(disk_dir), disk_dir)
    sizes, _ = sizes_for(req, target)
    page = parse_size(req.page_size) if req.page_size else target.page_size or 4 << 20
    run = RunShape(req.batch, req.seq or 2048, req.precision, req.update, req.needs_all_grads, req.max_staleness,
                   page, req.levels)
    if req.nproc == 1:
        found = largest_model(target, sizes, run)
    else:
        found = _largest_over_layouts(req, target, sizes, run, console)
    print_largest(found, target, console)
    return found


def _check_tensor_ranks(req: PlanRequest) -> None:
    if req.tp > 1 and (req.nproc % req.tp or (req.nproc_per_node and req.nproc_per_node % req.tp)):
        raise ConfigError(f"--tp {req.tp} must divide --nproc {req.nproc}"
                          + (f" and --nproc-per-node {req.nproc_per_node}" if req.nproc_per_node else ""))


def _largest_over_layouts(req: PlanRequest, target: Machine, sizes: Budgets, run: RunShape,
                          console: Console) -> Largest:
    """The largest model over every layout of ``req.nproc`` ranks: tensor parallel over each group size
    that divides a node's ranks (or ``--tp`` as given), the rest data parallel with every state split
    over its ranks; the most parameters win, then the fastest step."""
    from tiertrain.autoplan.largest_model import Cluster, NothingFits, largest_model
    from tiertrain.measure.collectives import measure_network, network_for
    from tiertrain.plan.update_modes import check_group_reads_alike, lags_apart

    if req.tp > 1:
        check_group_reads_alike(req.update, req.max_staleness)
    node = req.nproc_per_node or req.nproc
    tps = [req.tp] if req.tp > 1 else [t for t in range(1, node + 1) if node % t == 0]
    if lags_apart(req.update, req.max_staleness):  # a group's ranks must read alike: no tp there
        tps = [1]
    found = []
    for tp in tps:
        dp = req.nproc // tp
        links = target.network if req.machine else None
        tp_bps = links[0].bps if links else measure_network(tp, 64 << 20).all_reduce_bps if tp > 1 else 0.0
        net = network_for(dp, links, target.name, 64 << 20, req.nproc_per_node // tp if req.nproc_per_node else 0)
        try:
            got = largest_model(target, sizes, dataclasses.replace(run, cluster=Cluster(tp, tp_bps, net)))
        except NothingFits:
            console.print(f"  --tp {tp:<3d} dp {dp:<4d} nothing fits")
            continue
        console.print(f"  --tp {tp:<3d} dp {dp:<4d} {got.cfg.n_layer} x {got.cfg.d_model} "
                      f"({format_count(got.params)} params), predicted step {got.chosen.sim.step_s:.2f} s")
        found.append(got)
    if not found:
        raise NothingFits(f"no layout of {req.nproc} ranks fits even the smallest model: give more memory a rank")
    return max(found, key=lambda f: (f.params, -f.chosen.sim.step_s))
