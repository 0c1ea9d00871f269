"""``tiertrain.pipeline``: a model cut into pipeline stages over the run's ranks, each stage's states in
tiers, driven by torch's pipelining schedules (or FOLD3D's AIAO on torch's runtime schedule)::

    run = tiertrain.pipeline(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                             PipelineLayout(pp=2, schedule="aiao", micro_batches=8, segments=2), plan="stream")
    for x, y in batches:                  # every rank passes its data-parallel replica's batch
        loss = run.step(x, y)             # every micro-batch's forward and backward; the loss on every rank
        run.optimizer.step(); scheduler.step(); run.optimizer.zero_grad()

The ranks form a dp x pp mesh (``parallel.pipeline_mesh``); each rank tiers its stages with
``tiertrain.setup`` over its stages' data-parallel group, so every tier plan and data-parallel layout
works inside a stage. A rank holding several stages (AIAO's segments, interleaved's virtual stages)
gives each an equal share of its budgets.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiertrain.api.machine_budgets import machine_budgets
from tiertrain.api.setup import optimizer_groups, run_options, setup
from tiertrain.api.stages_optimizer import StagesOptimizer
from tiertrain.api.tensor_parallel import (
    built_on_meta,
    check_tensor_plan,
    lag_in_group,
    norm_over_group,
)
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.memory.system import compute_device
from tiertrain.models.gpt import token_loss
from tiertrain.models.init import init_in_place
from tiertrain.models.stages import StageCut, check_stageable, release_others
from tiertrain.parallel.agree import same_on_every_rank
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.group import ensure_process_group, world_from_env
from tiertrain.parallel.health import failure
from tiertrain.parallel.pipeline_mesh import PipelineMesh, pipeline_mesh
from tiertrain.parallel.pipeline_schedule import (
    Handoff,
    crosses_segments,
    schedule_for,
    stages_for,
)
from tiertrain.parallel.sequence_ops import sum_whole_gradients
from tiertrain.parallel.tensor_parallelize import parallelize_blocks, slice_sequence
from tiertrain.parallel.tensor_plans import (
    TensorPlan,
    check_pipeline_tensor,
    check_sequence_parallel,
)
from tiertrain.parallel.tensor_start import group_seed, same_start
from tiertrain.parallel.tied_stages import TiedStages
from tiertrain.plan import BUILTIN_PLANS, Plan, RunOptions
from tiertrain.plan.pipeline import PipelineLayout, fold, stage_plan
from tiertrain.plan.plan import plan_file
from tiertrain.plan.update_modes import rules
from tiertrain.precisions import torch_dtype
from tiertrain.runtime.rank_agreement import model_signature
from tiertrain.runtime.segment_inbox import SegmentInbox

FIX = "start every rank with the same model and pipeline flags (torchrun gives each rank the same command line)"


@dataclass
class Pipelined:
    """One rank's part of a pipelined run: its stages (tiered modules), the optimizer its loop steps, and
    ``step``, which runs one batch through the schedule."""

    layout: PipelineLayout
    mesh: PipelineMesh
    stages: list[nn.Module]
    indices: list[int]                      # each stage's place in the pipeline (virtual stage)
    optimizer: StagesOptimizer
    synced: list[int] = field(default_factory=list)  # the stages whose DP.sync was issued, in order, this step
    micro_losses: torch.Tensor | None = None  # the last step's micro-batches' losses (each divided by their count)
    tie: TiedStages | None = None           # this rank's side of a weight tied across the first and last stage
    slices: int = 1                         # sequence parallel: the sequence's slices between stages (tp), else 1
    _schedule: Any = None
    _shape: tuple[int, ...] | None = None
    _token_losses: list[torch.Tensor] = field(default_factory=list)  # with experts: each micro-batch's cross-entropy

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of one batch (token ids and their targets, as every rank
        of a data-parallel replica passes them: the first stage reads ``inputs``, the last ``targets``);
        the batch's loss (the mean over its micro-batches) on every rank of the pipeline; each micro-batch's
        share of it in ``micro_losses``."""
        self._schedule_for(tuple(inputs.shape))
        self.synced.clear()
        if self._balanced:  # what a step that raised part way left
            self._token_losses.clear()
            for stage in self.stages:
                stage.balance_seen.clear()
        first, last = self.mesh.pp_rank == 0, self.mesh.pp_rank == self.mesh.pp - 1
        losses: list[torch.Tensor] = []
        try:
            self._schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                                losses=losses if last else None)
            if not self._balanced:
                each = (torch.stack([x.detach().float().cpu() for x in losses]) if last
                        else torch.zeros(self.layout.micro_batches))
                self.mesh.pp_host.broadcast(each, src=self.mesh.pp - 1)  # from the last stage, which holds the loss
            else:
                each = self._with_balance(last)
            if self.tie is not None:
                self.tie.sum_grads()
        except RuntimeError as exc:  # a stage's sends and receives are torch's: a lost peer is named here
            beat = self.mesh.world.heartbeat
            lost = [] if isinstance(exc, torch.OutOfMemoryError) else beat.lost()
            if not lost:
                raise  # every rank alive: the error is this rank's own, as it was raised
            raise failure(beat, exc, "the pipeline's sends and receives", lost) from exc
        self.micro_losses = each
        return each.double().sum()  # as a loop adding each micro-batch's loss.item() sums them

    @property
    def _balanced(self) -> bool:
        """Whether the model's blocks add losses of their own (a mixture of experts' load balancing)."""
        return self.stages[0].balance_scale is not None

    def _with_balance(self, last: bool) -> torch.Tensor:
        """Each micro-batch's loss with the blocks' load-balancing losses, which every stage saw a part of: the
        last stage's cross-entropies and each stage's blocks' losses put in one table (every other entry 0)
        and summed over the pipeline, then added as ``GPT.forward`` adds them, micro-batch by micro-batch (the
        one-process run's loss bit for bit)."""
        m, cfg = self.layout.micro_batches, self.stages[0].config
        table = torch.zeros(m, 1 + cfg.n_layer)
        if last:
            table[:, 0] = torch.stack(self._token_losses).float().cpu()
        for stage in self.stages:
            for k, seen in enumerate(stage.balance_seen):
                table[k, 1 + stage.block_indices.start:1 + stage.block_indices.stop] = seen.float().cpu()
        self.mesh.pp_host.all_reduce(table)
        return torch.stack([(row[0] + cfg.aux_loss_coef * row[1:].mean()) / m for row in table])

    def _schedule_for(self, shape: tuple[int, ...]) -> None:
        """Torch's stages and schedule for batches of ``shape`` (made at the first step, and again where a
        batch of another shape comes: the stages are told their micro-batches' shapes up front)."""
        if shape == self._shape:
            return
        m = self.layout.micro_batches
        if len(shape) != 2 or shape[0] % m:
            raise ConfigError(f"a batch of shape {shape} does not split into {m} micro-batches of token rows; "
                              "give batches of (rows, tokens) with rows a multiple of the micro-batches")
        rows, tokens = shape[0] // m, shape[1]
        if tokens % self.slices:
            raise ConfigError(f"sequence parallel slices each sequence over {self.slices} ranks: give sequences whose "
                              f"length {self.slices} divides, not {tokens}")
        part = tokens // self.slices  # a hidden state crosses between stages as the rank's slice of the sequence
        ins = [self._meta(s.embeds, rows, tokens if s.embeds else part) for s in self.stages]
        outs = [self._meta(False, rows, tokens if s.heads else part, s.config.vocab_size if s.heads else None)
                for s in self.stages]
        stages = stages_for(self.stages, self.indices, self.layout, self.mesh.pp_group, compute_device(), ins, outs,
                            self._handoffs())
        self._schedule = schedule_for(stages, self.layout, self._loss, self.synced.append)
        self._shape = shape

    def _handoffs(self) -> list[Handoff]:
        """Each stage's part in FOLD3D's inter-segment lazy communication (AIAO): a segment's outputs sent to
        the next from host memory, received into the receiver's host pool (``runtime.segment_inbox``)."""
        host = self.mesh.pp_host.group
        out = []
        for module, v in zip(self.stages, self.indices):
            sends, receives = crosses_segments(self.layout, v)
            inbox = SegmentInbox(module.runtime.mem, host, compute_device()) if receives else None
            out.append(Handoff(host if sends else None, inbox))
        return out

    def _meta(self, ids: bool, rows: int, tokens: int, width: int | None = None) -> torch.Tensor:
        """One micro-batch's tensor between stages: token ids, or hidden states (or logits) in the compute
        dtype, as the model's blocks hand them on (a tiered block computes with its weights in that dtype, so
        no autocast is needed: the tests find the bf16 stages equal to a loop autocasting its forward)."""
        if ids:
            return torch.empty(rows, tokens, dtype=torch.long, device="meta")
        return torch.empty(rows, tokens, width or self.stages[0].hidden_size, device="meta",
                           dtype=self._dtype, requires_grad=True)

    @property
    def _dtype(self) -> torch.dtype:
        return torch_dtype(self.stages[0].runtime.plan.compute_dtype)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the batch's loss: the loop accumulating them divides so too (its
        cross-entropy kept for the loss reported where blocks add losses of their own)."""
        loss = token_loss(logits, targets)
        if self._balanced:
            self._token_losses.append(loss.detach())  # (to the host once the step is over)
        return loss / self.layout.micro_batches

    def close(self) -> None:
        """Every stage's runtime and memory, then the mesh's groups and heartbeat: each closed even where one
        before it raised (a lost rank's), the first error raised after."""
        _close_all(self.stages, self.mesh)


def _close_all(stages: list[nn.Module], mesh: PipelineMesh) -> None:
    closers = [c for s in stages for c in (s.runtime.close, s.runtime.mem.close)] + [mesh.close]
    failed: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - the rest still close; the first error is raised below
            failed = failed or exc
    if failed is not None:
        raise failed


def pipeline(model: nn.Module, optimizer: torch.optim.Optimizer, layout: PipelineLayout,
             memory: Budgets | None = None, plan: str | Plan = "stream", options: RunOptions | None = None,
             tp: int = 1, sequence_parallel: bool = False, **fields: Any) -> Pipelined:
    """Cut ``model`` into ``layout``'s stages over the run's ranks, tier this rank's stages as ``plan``
    says within ``memory`` (this rank's budgets, shared by its stages), and return what the loop drives.
    ``options`` (or its fields as keywords) as ``tiertrain.setup`` takes them; ``grad_accum`` is the
    layout's micro-batches. Parts of the model other ranks hold are moved to the meta device here, and the
    user's optimizer's groups become the run's (``run.optimizer`` shares them: a scheduler over either
    drives every stage). ``tp``: each stage's blocks cut over groups of that many ranks;
    ``sequence_parallel``: the sequence sliced over each group between its cut regions, and between the
    stages. A failure part way leaves the model and the optimizer partly changed: build both
    again."""
    opts = _options(options, fields, layout)
    plan = _plan_from_file(plan)
    if isinstance(plan, Plan):
        plan.parallel.check_run(tp, sequence_parallel, "the plan")
    _check_clipping(opts, plan)
    _check_precision(opts, plan)
    cut = check_stageable(model)
    _check_tied(cut, layout, opts, plan)
    optimizer_groups(optimizer, model)  # an AdamW, fresh, over every parameter: refused before anything changes
    cuts = _check_tensor(model, layout, tp, opts, plan, sequence_parallel)
    if tp > 1:
        opts = lag_in_group(plan, opts)
    ensure_process_group()
    layout.check(world_from_env() // tp, cut.n_blocks, layout.micro_batches)
    same_on_every_rank("the pipeline", {**_pipeline_fields(model, layout, opts, plan), "--tp": str(tp),
                                        "sequence parallel": str(sequence_parallel),
                                        "built on the meta device": str(built_on_meta(model))}, FIX)
    mesh = pipeline_mesh(layout.pp, tied=cut.ties and layout.pp > 1, tp=tp)
    tiered: list[nn.Module] = []
    try:
        _materialize_tied(cut, mesh)
        runs = fold(cut.n_blocks, layout.pp, layout.segments)
        indices = [v for v in range(layout.stages) if v % layout.pp == mesh.pp_rank]
        modules = [cut.stage(runs[v]) for v in indices]
        for module in modules:
            module.weigh_balance(layout.micro_batches, compute_device())
        if cuts is not None and mesh.tp_group is not None:
            _cut_blocks(cuts, modules, [runs[v].start for v in indices], optimizer, mesh.tp_group, sequence_parallel)
        stage_opts = [_stage_adamw(optimizer, m) for m in modules]
        release_others(model, modules)
        for group in optimizer.param_groups:  # the stages' optimizers hold this rank's originals now, each let
            group["params"] = []               # go of as setup replaces it
        parts = []
        for module, stage_opt, v, share in zip(modules, stage_opts, indices, _shares(memory, len(modules))):
            chosen = stage_plan(plan, runs[v], cut.n_blocks, max(map(len, runs))) if isinstance(plan, Plan) else plan
            t, topt = setup(module, stage_opt, share, plan=chosen, options=opts, collectives=mesh.stage_dp)
            if mesh.tp_group is not None:
                norm_over_group(t, mesh.tp_group)
                if sequence_parallel:
                    sum_whole_gradients(t, cuts.whole_in_block, mesh.tp_group)
            tiered.append(t)
            parts.append(topt)
        return Pipelined(layout, mesh, tiered, indices, StagesOptimizer(optimizer, parts, mesh.pp_host,
                                                                       opts.max_grad_norm), tie=_tied_side(tiered, mesh),
                         slices=tp if sequence_parallel else 1)
    except BaseException as exc:
        try:
            _close_all(tiered, mesh)
        except BaseException as closing:  # noqa: BLE001 - the error that stopped the setup is the one to see
            exc.add_note(f"closing what was made also failed: {closing!r}")
        raise


def _check_tensor(model: nn.Module, layout: PipelineLayout, tp: int, opts: RunOptions,
                  plan: str | Plan, sequence: bool = False) -> TensorPlan | None:
    """A pipeline whose stages' blocks are cut over ``tp`` ranks: a model a tensor-parallel plan cuts (that
    plan returned), the ranks in whole groups, no weight tied across the first and the last stage (its
    pair of ranks is one per pipeline, not per group, yet); with ``sequence``, a model whose sequence a
    pipeline can slice."""
    if tp == 1:
        if sequence:
            raise ConfigError("sequence parallel slices the sequence over a tensor-parallel group: give tp above 1, "
                              "or sequence_parallel=False")
        return None
    world = world_from_env()
    if tp < 1 or world % (layout.pp * tp):
        raise ConfigError(f"--pp {layout.pp} x --tp {tp} must divide the run's {world} ranks: give --nproc a "
                          f"multiple of {layout.pp * max(tp, 1)}")
    check_tensor_plan(plan, opts)  # (a plan file already read)
    cut = check_pipeline_tensor(model, tp, layout.pp)
    if sequence:
        check_sequence_parallel(model, cut)
    return cut


def _cut_blocks(plan: TensorPlan, modules: list[nn.Module], firsts: list[int], optimizer: torch.optim.Optimizer,
                group: Collectives, sequence: bool = False) -> None:
    """Each stage's blocks (the first of each the model's ``firsts``; a stage keeps them where the whole
    model does, ``plan.blocks_at``) cut into this rank's shards over ``group``, every rank of it from the
    same whole stage; the user's optimizer pointed at them. ``sequence``: the sequence sliced as the model's
    first block begins and put together before the final norm, in the stages that hold them."""
    new_of: dict[int, nn.Parameter] = {}
    seed = group_seed(group)
    for module, first in zip(modules, firsts):
        same_start(module, group, seed, plan.blocks_at)
        new_of.update(parallelize_blocks(plan, plan.blocks(module), group.rank, group, seed, first, sequence))
        if sequence:
            slice_sequence(module, plan, group, first=module.embeds, last=module.heads)
    for g in optimizer.param_groups:
        g["params"] = [new_of.get(id(p), p) for p in g["params"]]


def _check_tied(cut: StageCut, layout: PipelineLayout, opts: RunOptions, plan: str | Plan) -> None:
    """A tied weight's two stages sum their gradients before the step: none may be updated during backward,
    and the two ends must be on two ranks."""
    if not cut.ties:
        return
    update = opts.update or (plan.update if isinstance(plan, Plan) else "sync")
    if rules(update).updates_as_final or rules(update).loops:
        raise ConfigError(f"a tied embedding in a pipeline sums the first and the last stage's gradients of it before "
                          f"the step, and the {update} update mode updates blocks before that: use update='sync', or "
                          "untie the model's head (tie_embeddings / tie_word_embeddings=False)")
    if layout.pp == 1 and layout.stages > 1:
        raise ConfigError("a tied embedding's first and last stage on one rank (pp = 1) is not supported: give "
                          "segments=1, or more pipeline ranks")


def _materialize_tied(cut: StageCut, mesh: PipelineMesh) -> None:
    """A tied weight of a model built on the meta device, drawn on the first stage's rank and sent to the
    last's, so the last stage's copy starts equal to it (each stage's other weights are drawn where they
    live, and its replicas take its first replica's); only the two ends hold it, one tensor at a time."""
    original = getattr(cut.embedding, "weight", None)
    if mesh.tied is None or original is None or not original.is_meta:
        return
    value = torch.empty(original.shape, dtype=torch.float32)
    if mesh.pp_rank == 0:
        init_in_place("weight", value)  # a matrix: drawn as any
    mesh.tied.broadcast(value, src=0)  # the pair's first rank: the first stage's
    torch.utils.swap_tensors(original, nn.Parameter(value.to(original.dtype), original.requires_grad))


def _tied_side(tiered: list[nn.Module], mesh: PipelineMesh) -> TiedStages | None:
    """This rank's side of the tied embedding (the first stage's weight, or the last stage's copy), if any."""
    for stage in tiered:
        if stage.tied:
            param = dict(stage.named_parameters())[stage.tied_name]  # the tiered stage's (setup registers its own)
            if stage.heads:  # the last stage's copy: its norm leaves it out (the first stage's counts it)
                stage.runtime.leave_out_of_norm(param)
            return TiedStages(mesh.tied, mesh.stage_dp, stage.runtime, param)
    return None


def _plan_from_file(plan: str | Plan) -> str | Plan:
    """A plan named by its file, read (a whole model's, or a stage's from ``tiertrain plan --pp``: each stage
    takes its blocks' plans from it); a built-in name as it is."""
    if isinstance(plan, Plan) or plan in BUILTIN_PLANS or plan == "auto":
        return plan
    return plan_file(plan)


def _pipeline_fields(model: nn.Module, layout: PipelineLayout, opts: RunOptions, plan: str | Plan) -> dict[str, str]:
    """What every rank of a pipeline must hold alike (a stage's ranks compare the rest among themselves):
    a rank that clips, or runs another schedule, would wait for sends or sums the others never make."""
    return {"the layout": repr(layout), "the model (its parameters' names, shapes and dtypes)": model_signature(model),
            "the run's options": json.dumps(dataclasses.asdict(opts), sort_keys=True),
            "the plan": plan.to_json() if isinstance(plan, Plan) else plan}


def _options(options: RunOptions | None, fields: dict[str, Any], layout: PipelineLayout) -> RunOptions:
    """The run's options with the layout's micro-batches as its accumulation; what a pipeline cannot run
    yet refused in one line."""
    opts = run_options(options, fields)
    if opts.grad_accum not in (1, layout.micro_batches):
        raise ConfigError(f"a pipelined step accumulates its {layout.micro_batches} micro-batches: leave grad_accum "
                          f"out (it is --micro-batches), not {opts.grad_accum}")
    # FOLD3D's DP.sync: a stage's gradients reduced once a step, after its last micro-batch's backward (not M times)
    return dataclasses.replace(opts, grad_accum=layout.micro_batches, reduce_every=opts.reduce_every or "step")


def _check_clipping(opts: RunOptions, plan: str | Plan) -> None:
    """The global norm spans every stage: no block may be updated before the last stage's backward ends
    (a plan file is read first)."""
    update = opts.update or (plan.update if isinstance(plan, Plan) else "sync")
    if opts.clips and rules(update).updates_as_final:
        raise ConfigError(f"clipping in a pipelined run needs every stage's gradients before any update, and the "
                          f"{update} update mode updates each block as its gradients come: use --update sync, or "
                          "leave clipping out")


def _check_precision(opts: RunOptions, plan: str | Plan) -> None:
    """fp32 and bf16 stages; fp16's dynamic loss scale would have to be agreed by every stage at every step
    (a stage skipping a step the others take would part the model): refused, whether asked or a plan file's."""
    dtype = opts.compute_dtype or (plan.compute_dtype if isinstance(plan, Plan) else "fp32")
    if dtype == "fp16":
        raise ConfigError("pipelined runs compute in fp32 or bf16, not fp16 (its loss scale is not agreed over the "
                          "stages): use bf16")


def _shares(memory: Budgets | None, n: int) -> list[Budgets]:
    """This rank's budgets split evenly over its ``n`` stages (each stage's runtime plans within its share;
    each makes its own private directory under the disk tier's)."""
    if memory is None:
        taken = machine_budgets(compute_device())
        print(f"tiertrain: {taken.describe()}", file=sys.stderr)
        memory = taken.budgets
    if n == 1:
        return [memory]
    return [Budgets(memory.device // n, memory.host // n, memory.disk // n, memory.disk_dir) for _ in range(n)]


def _stage_adamw(source: torch.optim.Optimizer, stage: nn.Module) -> torch.optim.Optimizer:
    """An AdamW over the stage's parameters with the user's groups' hyperparameters, group for group (a
    group with none of the stage's parameters stays, empty, so group indices match the user's); a tied
    weight's copy in the group of the weight it copies."""
    mine = {id(p): p for p in stage.parameters()}
    mine.update({id(original): copy for copy, original in stage.copy_of.items()})
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [mine[id(p)] for p in g["params"]
                                                                          if id(p) in mine]}
              for g in source.param_groups]
    return torch.optim.AdamW(groups)
