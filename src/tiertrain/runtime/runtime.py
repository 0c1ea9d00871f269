"""Wires one model to the memory layer under a plan: block groups, the device cache, the update
mode, the backward pass, and the hooks that drive a step through the groups.

The runtime keeps what a run shares across plans (the groups' chunks, the step clock, the loss
scaler) and decides nothing the plan does not say: which mode runs updates is chosen once per plan
(``modes.make_mode``), where each state lives is the plan's. A new plan (``replan``) takes effect
through ``take_plan``, the path setup's own plan takes too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from tiertrain.memory import MemorySystem, Tier
from tiertrain.optim import AdamWHyper
from tiertrain.parallel import Collectives
from tiertrain.parallel.expert_layer import expert_layers
from tiertrain.parallel.experts import apply_expert_parallel
from tiertrain.parallel.hybrid import distinct_over, sharded_collectives
from tiertrain.parallel.placement import checked
from tiertrain.plan import Plan, RunOptions
from tiertrain.plan.bytes import grad_tier, reductions_in_flight, updated_away
from tiertrain.plan.fit import has_own_place
from tiertrain.plan.update_modes import rules
from tiertrain.runtime.backward import BackwardPass
from tiertrain.runtime.block_group import F32, BlockGroup
from tiertrain.runtime.blocks import Block, block_layout, block_sizes, find_blocks
from tiertrain.runtime.build import BuildSpec, LetGo, build_groups
from tiertrain.runtime.cache import DeviceCache
from tiertrain.runtime.context import RunContext
from tiertrain.runtime.hooks import apply_switches, install_block_hooks, install_grad_hooks
from tiertrain.runtime.in_place_grads import Target, handled, in_place_uses, write_in_place
from tiertrain.runtime.loss_scale import LossScaler
from tiertrain.runtime.modes import ModeContext, make_mode
from tiertrain.runtime.rank_agreement import agreed_collectives
from tiertrain.runtime.read_ahead import ReadAhead
from tiertrain.runtime.slots import DeviceSlot
from tiertrain.runtime.state_moves import StateMoves
from tiertrain.runtime.step_clock import StepClock
from tiertrain.runtime.step_norm import StepNorm
from tiertrain.runtime.switches import HostStash
from tiertrain.runtime.tied import extra_uses, give_own_leaf


class Runtime:
    def __init__(self, model: nn.Module, param_groups: list[dict[str, Any]], group_of_param: dict[int, int],
                 mem: MemorySystem, plan: Plan, options: RunOptions, comm: Collectives | None = None,
                 let_go: LetGo | None = None) -> None:
        """``plan``: resolved for this run (``plan.fit.resolve``: whether backward waits for updates to free
        gradient chunks is its decision, and what the device pool maps). ``param_groups``: the optimizer's
        (live dicts: schedulers write ``lr`` into them). ``let_go(original, new)``: each of the model's
        parameters as its block is built (``build_groups``)."""
        if plan.resolved is None:
            raise ValueError("internal: the runtime runs a resolved plan (tiertrain.plan.fit.resolve)")
        self.model, self.mem, self.options = model, mem, options
        self.param_groups = param_groups
        self.comm = checked(agreed_collectives(model, plan, options, comm), mem.tier_of)
        self.clock = StepClock(options.grad_accum)
        self.ctx = RunContext(mem, self.comm, self.clock, self.hypers)
        blocks = find_blocks(model, options.blocks)
        self.sizes = block_sizes(blocks, plan.parallel.ep)  # what plan.fit counts (a replan counts the same)
        self.experts = apply_expert_parallel(self.comm, plan.parallel.dp, plan.parallel.ep, model)
        self.ctx.shards = self.shards = sharded_collectives(self.comm, plan.parallel)
        self.replaced: dict[int, nn.Parameter] = {}  # the user's parameter (id) -> the one now in its place
        rest = [p for _, p in blocks[-1].params]
        tied = extra_uses(model, rest) if options.train else []
        in_place = in_place_uses(model, rest) if options.train else []
        spec = BuildSpec(plan, options, group_of_param, plan.resolved.bounded,
                         self._reduced_at_end(blocks, bool(tied or in_place)), let_go)
        groups = build_groups(self.ctx, model, blocks, spec, self.replaced, self.experts)
        self.dropped = self.experts.hold_own(model, [p for b in blocks for _, p in b.params], self.replaced) \
            if self.experts is not None else set()
        self.scaler = LossScaler() if options.train and plan.compute_dtype == "fp16" else None
        # the step needs the global norm (clipping) or the fp16 overflow check before any update
        self.waits_for_norm = options.clips or self.scaler is not None
        self.own_forwards = {g.index: vars(g.block.module).get("forward") for g in groups if g.block.module}
        self.stashes: dict[int, HostStash] = {}  # offload_hidden: where each block's saved activations wait
        self._handles: list[RemovableHandle] = []
        self.backward: BackwardPass | None = None
        self.closed = False
        self.take_plan(groups, plan)
        early = lambda: self.backward.tied_early  # noqa: E731
        for module, index in in_place:  # the head's and the embedding's gradients made in the rest's chunk
            write_in_place(module, Target(lambda: self.groups[-1], index), early)
        for use in tied:  # a tied weight's other uses send their gradients on at once where the plan allows
            if not handled(use.module):
                give_own_leaf(use, lambda i, leaf: self.groups[-1].tied_grad_arrived(i, leaf), early)

    # -- a plan taking effect --------------------------------------------------------------
    def take_plan(self, groups: list[BlockGroup], plan: Plan) -> None:
        """Run the groups (built for ``plan`` by ``build_groups``, or by a replan from the chunks it
        moved) under ``plan``: its device cache, state moves, update mode, backward pass and read-ahead,
        the groups' hooks, and each block's activation switches."""
        for h in self._handles:
            h.remove()
        self.groups, self.plan, self.bounded_grads = groups, plan, plan.resolved.bounded
        ctx = self.ctx
        ctx.moves = StateMoves(self.mem, plan.read_ahead)
        ctx.cache = DeviceCache([g for g in groups if g.plan.stream], _ring(groups), plan.prefetch)
        self.norm = StepNorm(groups, self._model_order(), distinct_over(self.shards), self.experts, self.scaler,
                             self.clock)
        ctx.mode = self.mode = make_mode(ModeContext(groups, self.clock, self.norm, ctx.moves, self.hypers,
                                                     self._settle, self.options.max_grad_norm, self.waits_for_norm,
                                                     plan))
        late = self.backward.late_flushes if self.backward is not None else None
        ctx.backward = self.backward = BackwardPass(groups, self.clock, self.mode, self.mem, self.bounded_grads,
                                                    plan.update_workers, self._tied_grads_early(), late,
                                                    reductions_in_flight(plan.parallel.hybrid), self._lands_at_step(plan))
        ctx.ahead = self.reads = ReadAhead(groups, plan, self.clock, self.mode, ctx.moves, self.backward,
                                           self._token_dependent())
        self._handles = []
        self.stashes.clear()
        for g in groups:
            if self.options.train:
                self._handles += install_grad_hooks(g)
            if g.block.module is not None:
                self._handles += install_block_hooks(g)
                stash = apply_switches(g, self.mem, self.own_forwards.get(g.index))
                if stash is not None:
                    self.stashes[g.index] = stash

    @property
    def cache(self) -> DeviceCache:
        return self.ctx.cache

    @property
    def moves(self) -> StateMoves:
        return self.ctx.moves

    def _lands_at_step(self, plan: Plan) -> bool:
        """Whether the last micro-batch's reductions stay in flight until the step (``reduce_every="step"``):
        not where an update loop takes gradients whenever they come (lockfree), nor where the mode starts every
        update when backward ends, after the global norm (overlap with clipping or fp16), which needs them."""
        mode = rules(plan.update)
        return plan.reduce_every == "step" and not mode.loops and not (mode.updates_as_final and self.waits_for_norm)

    def _settle(self) -> None:
        """A step begins its updates: every copy into a slot landed, and forward may read ahead again."""
        self.ctx.cache.settle()
        self.reads.restart()

    # -- what is decided once per run, from the blocks ------------------------------------------
    def _reduced_at_end(self, blocks: list[Block], rest_at_end: bool) -> frozenset[str]:
        """Blocks whose gradients are reduced only when backward ends: over several ranks a mixture-of-
        experts block without expert parallel (an expert may get tokens on one rank and none on another,
        so whether the block's gradients are all in mid-backward differs by rank), and the rest where a
        tied weight's other uses, or gradients written in place (``runtime.in_place_grads``), give gradients not
        among those counted to flush it early."""
        names = set()
        if self.comm.world_size > 1 and self.experts is None:
            names |= {b.name for b in blocks if b.module is not None and expert_layers(b.module)}
        if rest_at_end:
            names.add(blocks[-1].name)
        return frozenset(names)

    def _token_dependent(self) -> set[int]:
        """Groups whose gradients depend on the tokens a step routes: experts, and blocks holding them."""
        return {g.index for g in self.groups
                if g.experts is not None or (g.block.module is not None and expert_layers(g.block.module))}

    def _tied_grads_early(self) -> bool:
        """Whether a tied weight's other uses (``runtime.tied``) put their gradients into the rest's
        grad chunk as they arrive: with one process and one micro-batch (several would add the uses in
        another order than autograd: not bitwise), not where an update loop may take the chunk between
        the uses (lockfree), in fp32 with the chunk on the compute device's memory (else the sum would
        differ from autograd's, or cross devices: not tried on a GPU yet), and where gradients are bounded
        only if the budget gives the rest's chunk a place of its own (``plan.bytes.has_own_place``),
        so that holding it through backward leaves the blocks' count alone (``BackwardPass._grads_alive``)."""
        if self.comm.world_size > 1 or self.options.grad_accum > 1 or self.mode.takes_grads_any_time:
            return False
        rest = self.groups[-1]
        if self.plan.compute_dtype != "fp32" or (self.mem.device.type != "cpu" and grad_tier(rest.plan) is Tier.HOST):
            return False  # autograd sums the uses in the compute dtype, and on the device
        if not (self.bounded_grads and updated_away(rest.plan)):
            return True
        tier = grad_tier(rest.plan)
        return has_own_place(rest.state_numel * F32.itemsize, [
            g.state_numel * F32.itemsize for g in self.groups[:-1] if updated_away(g.plan) and grad_tier(g.plan) is tier])

    def _model_order(self) -> list[tuple[BlockGroup, int]]:
        """(group, index) of every parameter in ``model.parameters()`` order, as clip_grad_norm_ sees them."""
        where = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        return [where[id(p)] for p in self.model.parameters() if id(p) in where]

    def hypers(self) -> list[AdamWHyper]:
        """The optimizer's hyperparameters as they are now, typed (a snapshot)."""
        return [AdamWHyper.of(g) for g in self.param_groups]

    # -- the loop's calls ------------------------------------------------------------------
    def begin_forward(self) -> None:
        """The model's forward begins: the rest (embeddings, head) is used first and last, and the device
        cache plans this pass from the last one's accesses (an evaluation pass does not become that order)."""
        self.groups[-1].fetch()
        if torch.is_grad_enabled():
            self.ctx.cache.new_pass()

    def grad_piece(self, param: nn.Parameter) -> tuple[torch.Tensor | None, int, bool]:
        """After backward, every reduction landed: this rank's piece of ``param``'s final gradient (a flat fp32
        view into its block's grad chunk, to be changed in place before the step: a tied weight's sum over
        the pipeline stages holding it; None where the rank holds none of it), where the piece starts in the
        flattened parameter, and whether the block is sharded (its other pieces on the other replicas)."""
        self.backward.land()
        g, i = self._find(param)
        piece = g.grad_piece(i)
        return (None, 0, g.shard is not None) if piece is None else (*piece, g.shard is not None)

    def leave_out_of_norm(self, param: nn.Parameter) -> None:
        """``param``'s gradient out of this runtime's norm (a tied weight's copy: another stage counts it)."""
        self.norm.leave_out(*self._find(param))

    def _find(self, param: nn.Parameter) -> tuple[BlockGroup, int]:
        for g in self.groups:
            for i, p in enumerate(g.params):
                if p is param:
                    return g, i
        raise ValueError("the parameter is not one of this runtime's")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The loop's ``clip_grad_norm_``, as the update mode answers it."""
        self.backward.land()
        return self.mode.clip_grad_norm_(max_norm, norm_type)

    def step(self) -> None:
        """The step's updates. Reductions the last backward left in flight (``BackwardPass.lands_at_step``)
        land here, or, where no update waits for every gradient (no norm, no fp16 check, gradients not
        bounded), each at its block's next use (``BackwardPass.hand_over``: FOLD3D's DP.sync under the
        next forward), which then updates it first."""
        later = self.backward.hand_over() if self._lands_later() else {}
        self.backward.land()
        if self.clock.nonfinite_norm:
            raise FloatingPointError(f"the gradient norm is {float(self.norm.last_norm)}: no block was updated; "
                                     "lower the learning rate, or find where the loss or the gradients overflow")
        self.mode.step(later)

    def _lands_later(self) -> bool:
        """Whether the step may leave reductions in flight to land at their blocks' next use: the update of a
        block then needs its own gradients only (no global norm or fp16 check waits for all), and the host
        need not free their chunks for the next backward (bounded gradients)."""
        return self.backward.lands_at_step and not self.waits_for_norm and not self.bounded_grads

    def pop_staleness(self) -> int | None:
        """How many steps the params a forward used lagged at most since last asked; None where the
        update mode never lets them lag."""
        return self.mode.pop_staleness() if self.mode.reports_staleness else None

    @property
    def steps_taken(self) -> int:
        return self.clock.steps_taken

    def wait_updates(self) -> None:
        """Every gradient taken into the states and every state home (checkpoints, the end)."""
        self.backward.land()
        self.mode.wait_all()

    def zero_grad(self) -> None:
        self.backward.abandon()  # reductions left by a backward that raised: landed and dropped below
        for g in self.groups:
            g.abandon_reduction()
        for g in self.groups:
            g.forget_fresh_grads()
            self.mode.zero_grad(g)
        self.clock.micro = 0

    def close(self) -> None:
        """Every update landed and the workers and collectives stopped (once; again does nothing). An update
        that failed raises its error here too, after the workers and collectives are stopped."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.backward.running:  # a backward raised and no zero_grad followed: drop what it left in flight
                self.zero_grad()
            self.wait_updates()  # an update that failed raises here, once the rest is stopped below
        finally:
            self.mode.close()
            self.comm.close()
            if self.shards is not self.comm:  # hybrid sharding's groups
                self.shards.close()
            if self.experts is not None:
                self.experts.a2a.close()
                self.experts.replicas.close()


def _ring(groups: list[BlockGroup]) -> list[DeviceSlot]:
    """The slots the streamed blocks share, each once, in the order the groups hold them."""
    seen, out = set(), []
    for g in groups:
        if g.plan.stream and id(g.slot) not in seen:
            seen.add(id(g.slot))
            out.append(g.slot)
    return out


__all__ = ["Runtime", "block_layout"]
