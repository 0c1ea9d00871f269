"""Wires one model to the memory layer under a plan: block groups, the device cache, the update
mode, and the hooks that drive a step through them.

The runtime keeps what a step shares across blocks (its micro-batch count, the global norm and
the clip coefficient, the loss scaler) and decides nothing the plan does not say: which mode
runs updates is chosen once (``modes.make_mode``), where each state lives is the plan's.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import torch
import torch.nn as nn

from tiertrain.memory import Kind, MemorySystem, Tier
from tiertrain.optim import AdamWHyper, clip_coefficient, total_norm
from tiertrain.parallel.experts import expert_parallel, moe_layers
from tiertrain.parallel.norm import sharded_norm
from tiertrain.parallel import Collectives, collectives_for
from tiertrain.plan import Plan, RunOptions
from tiertrain.plan.bytes import grad_floors, grad_tier, has_own_place, in_pieces, updated_away
from tiertrain.plan.reads import forward_reads
from tiertrain.runtime.block_group import F32, BlockGroup
from tiertrain.runtime.blocks import find_blocks
from tiertrain.runtime.build import LetGo, build_groups
from tiertrain.runtime.cache import DeviceCache
from tiertrain.runtime.hooks import apply_switches, install_block_hooks, install_grad_hooks
from tiertrain.runtime.loss_scale import LossScaler
from tiertrain.runtime.modes import make_mode
from tiertrain.runtime.state_moves import StateMoves
from tiertrain.runtime.switches import HostStash
from tiertrain.runtime.tied import extra_uses, give_own_leaf

REDUCTIONS_IN_FLIGHT = 1  # a block's reduction runs under the next block's backward (runtime.reduction)


class Runtime:
    def __init__(self, model: nn.Module, param_groups: list[dict[str, Any]], group_of_param: dict[int, int],
                 mem: MemorySystem, plan: Plan, options: RunOptions, transient_grads: bool = False,
                 comm: Collectives | None = None, let_go: LetGo | None = None) -> None:
        """``param_groups``: the optimizer's (live dicts: schedulers write ``lr`` into them).
        ``transient_grads``: the host cannot hold every block's gradients, so backward waits for an
        update to free a gradient chunk (overlap without clipping or accumulation only; setup decides).
        ``let_go(original, new)``: each of the model's parameters as its block is built (``build_groups``)."""
        self.model, self.mem, self.plan, self.options = model, mem, plan, options
        self.param_groups = param_groups
        self.comm = comm or collectives_for(plan.parallel.world_size)
        blocks = find_blocks(model, options.blocks)
        self.experts = expert_parallel(self.comm, plan.parallel.dp, plan.parallel.ep, model)
        self.replaced: dict[int, nn.Parameter] = {}  # the user's parameter (id) -> the one now in its place
        self.groups: list[BlockGroup] = build_groups(mem, self.comm, model, blocks, plan, options, group_of_param,
                                                     self.replaced, self.experts, let_go)
        self.dropped = self._keep_held_experts(blocks)
        if self.comm.world_size > 1:
            for g in self.groups:  # an expert may get tokens on one rank and none on another, so whether the
                if g.experts is None and g.block.module is not None and moe_layers(g.block.module):
                    g.reduces_at_end = True  # block's gradients are all in mid-backward differs by rank
        self.moves = StateMoves(mem, plan.read_ahead)
        self.mode = make_mode(self)
        self.cache = DeviceCache([g for g in self.groups if g.plan.stream], self._slots(), mem.mover, plan.prefetch,
                                 ready=self.params_ready)
        self.stashes: dict[int, HostStash] = {}  # offload_hidden: where each block's saved activations wait
        self.own_forwards = {g.index: vars(g.block.module).get("forward") for g in self.groups if g.block.module}
        for g in self.groups:
            if options.train:
                install_grad_hooks(self, g)
            if g.block.module is not None:
                install_block_hooks(self, g)
        self.transient_grads = transient_grads
        self.tied_early = False  # a tied weight's other uses send their gradients on at once (``wire``)
        self._late_flushes: set[int] | None = None  # blocks a backward did not flush as they came (None: none ran yet)
        self._flushed_early: set[int] = set()       # blocks this backward flushed as their gradients came in
        if options.train:
            rest = self.groups[-1]
            for use in extra_uses(model, rest.params):
                give_own_leaf(use, lambda i, leaf: self.tied_grad_arrived(rest, i, leaf), lambda: self.tied_early)
                rest.reduces_at_end = True  # a leaf's gradient is not among those counted to flush it early
        self.wire()
        self.scaler = LossScaler() if options.train and plan.compute_dtype == "fp16" else None
        # the step needs the global norm (clipping) or the fp16 overflow check before any update
        self.waits_for_norm = options.clips or self.scaler is not None
        self.steps_taken = 0         # optimizer steps the user has taken
        self.micro = 0               # backward passes in the current accumulation window
        self.last_norm: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None
        self.updates_started = False
        self.skip_step = False       # fp16: this step's gradients overflowed; no block is updated
        self.nonfinite_norm = False  # overlap with clipping: the norm was NaN/inf, so no update was started
        self._in_backward = False
        self._reducing: list[BlockGroup] = []  # blocks whose gradients' reduction is in flight, oldest first
        self._order = self._model_order()

    def wire(self) -> None:
        """Connect the groups to the cache and the update mode of the current plan, and apply its
        switches (at setup, and again when a new plan takes effect)."""
        self.stashes.clear()
        floors = self._grad_floors()
        for g in self.groups:
            g.acquire, g.ready, g.params_written = self.cache.acquire, self.params_ready, self.cache.invalidate
            g.grad_floors = floors.get(grad_tier(g.plan), (0, 0, 0)) if updated_away(g.plan) else (0, 0, 0)
            if g.block.module is not None:
                stash = apply_switches(self, g)
                if stash is not None:
                    self.stashes[g.index] = stash
        # the blocks whose states forward reads (a slot filled from the master keeps it on disk: it comes
        # from the slot as that block's backward begins)
        reads = forward_reads(self.plan)
        self._backward_first = [self.groups[i] for i in reads.first]
        self._while_idle = [self.groups[i] for i in reads.while_idle]
        read = [*self._backward_first, *self._while_idle]
        self._read_ids = {g.index for g in read}
        self._reads_experts = any(g.experts is not None or (g.block.module is not None and moe_layers(g.block.module))
                                  for g in read)  # whose gradients depend on the tokens
        self.restart_reads()
        self.tied_early = self._tied_grads_early()
        resident = [g for g in self.groups[:-1] if g.shard is not None and not g.plan.stream]
        self._resident_after = {a.index: b for a, b in zip(resident, resident[1:])}  # ZeRO-2 blocks, forward order

    def _grad_floors(self) -> dict[Tier, tuple[int, int, int]]:
        """With gradients bounded (``transient_grads``), per tier: ``plan.bytes.grad_floors`` of the
        chunks updates take away there."""
        if not self.transient_grads:
            return {}
        away: dict[Tier, list[BlockGroup]] = {}
        for g in self.groups:
            if updated_away(g.plan):
                away.setdefault(grad_tier(g.plan), []).append(g)
        return {tier: grad_floors([g.state_numel * F32.itemsize for g in gs], [g.nbytes for g in gs],
                                  self.comm.world_size) for tier, gs in away.items()}

    def _tied_grads_early(self) -> bool:
        """Whether a tied weight's other uses (``runtime.tied``) put their gradients into the rest's
        grad chunk as they arrive: with one process and one micro-batch (several would add the uses in
        another order than autograd: not bitwise), not lockfree (its loop may take the chunk between
        the uses), in fp32 with the chunk on the compute device's memory (else the sum would differ
        from autograd's, or cross devices: not tried on a GPU yet), and where gradients are bounded
        only if the budget gives the rest's chunk a place of its own (``plan.bytes.has_own_place``),
        so that holding it through backward leaves the blocks' count alone (``_grads_alive``)."""
        if self.comm.world_size > 1 or self.options.grad_accum > 1 or self.plan.update == "lockfree":
            return False
        rest = self.groups[-1]
        if self.plan.compute_dtype != "fp32" or (self.mem.device.type != "cpu" and grad_tier(rest.plan) is Tier.HOST):
            return False  # autograd sums the uses in the compute dtype, and on the device
        if not (self.transient_grads and updated_away(rest.plan)):
            return True
        tier = grad_tier(rest.plan)
        return has_own_place(rest.state_numel * F32.itemsize, [
            g.state_numel * F32.itemsize for g in self.groups[:-1] if updated_away(g.plan) and grad_tier(g.plan) is tier])

    def _keep_held_experts(self, blocks: list) -> set[int]:
        """Expert parallel: each MoE layer keeps the experts this rank holds and exchanges tokens for
        the rest. The ids of the model's parameters this rank does not hold (the other ranks' experts)."""
        if self.experts is None:
            return set()
        for m in moe_layers(self.model):
            m.keep_experts(self.experts.owned(m.n_experts), self.experts)
        held = {id(p) for p in self.model.parameters()} | set(self.replaced)
        return {id(p) for b in blocks for _, p in b.params if id(p) not in held}

    def _slots(self) -> list:
        seen, out = set(), []
        for g in self.groups:
            if g.plan.stream and id(g.slot) not in seen:
                seen.add(id(g.slot))
                out.append(g.slot)
        return out

    def _model_order(self) -> list[tuple[BlockGroup, int]]:
        """(group, index) of every parameter in ``model.parameters()`` order, as clip_grad_norm_ sees them."""
        where = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        return [where[id(p)] for p in self.model.parameters() if id(p) in where]

    def hypers(self) -> list[AdamWHyper]:
        """The optimizer's hyperparameters as they are now, typed (a snapshot)."""
        return [AdamWHyper.of(g) for g in self.param_groups]

    def update_order(self) -> list[BlockGroup]:
        """The rest (embeddings) first: the next forward starts there."""
        return self.groups[-1:] + self.groups[:-1]

    # -- forward -----------------------------------------------------------------------
    def forward_begins(self, g: BlockGroup) -> None:
        """A block's forward is about to run: its params must be there. Then the states of the
        blocks whose backward comes first start coming in from disk as soon as their last write-back
        has landed, so the disk keeps working through the forward, where it would otherwise wait
        for backward's first trigger."""
        g.fetch()
        if g.experts is not None:
            g.experts.fetch()
        following = self._resident_after.get(g.index)
        if following is not None and not self._in_backward:  # ZeRO-2: the next resident block's new params,
            following.gather_ahead()                         # gathered under this one (not in a recompute:
            #                                                  overlap's updates publish then, rank by rank)
        if self.final_micro() and self.mode.reads_ahead:
            self._read_during_forward()

    def _read_during_forward(self) -> None:
        """The states of the blocks backward reaches first start in from disk as soon as their last
        write-back has landed, so the disk keeps working through the forward, where it would otherwise
        wait for backward's first trigger; once those are in and no update or write-back runs, the next
        ones into the update workers' places, where updates follow backward (``plan.reads``)."""
        if self._in_backward:  # a recompute's forward: these blocks' updates may have run already
            return
        self._unread = [g for g in self._unread if self.moves.reading_full() or not self.moves.read_ahead(g, block=False)]
        if self._unread or not self._idle_unread or not self._updates_follow_backward() or not self._updates_idle():
            return
        places = self.plan.read_ahead + 2 * self.plan.update_workers
        while self._idle_unread and self.moves.read_ahead(self._idle_unread[0], block=False, places=places):
            self._idle_unread.pop(0)

    def _updates_follow_backward(self) -> bool:
        """Whether every block forward may read is updated in backward order, as its backward ends: in
        overlap mode without a global norm to wait for, once a backward has shown each of them flushing
        as its gradients came in. One that flushes only when backward ends (a parameter that got no
        gradient; reduced at the end) is updated after blocks that were not read in, while holding its
        place: the host would hold more than the budget counts. Never with experts, whose gradients
        depend on the tokens."""
        if self.plan.update != "overlap" or self.waits_for_norm or self._late_flushes is None:
            return False
        return not self._reads_experts and not self._read_ids & self._late_flushes

    def _updates_idle(self) -> bool:
        """No update runs or waits, and every write-back has landed."""
        return all(g.pending is None or g.pending.done() for g in self.groups) and self.moves.written()

    # -- backward ----------------------------------------------------------------------
    def backward_begins(self, g: BlockGroup) -> None:
        """A block's backward is about to run: a streamed block comes back, and its states start in
        (not in lockfree mode: there a block's loop may be moving them, and nothing waits for them).
        Where its slot was just filled from its fp32 master on disk, the master is copied from the
        slot, not read from disk a third time in the step (forward, backward, update)."""
        if g.plan.stream:
            g.fetch()
        if self.final_micro() and self.mode.reads_ahead:  # a slot filled from the master on disk holds it now
            self.moves.read_ahead(g, slot=g.slot if g.fills_slot_from_disk and g.shard is None else None)

    def grad_arrived(self, g: BlockGroup) -> None:
        self._backward_runs()
        g.grad_count += 1
        if g.grad_count == len(g.params) and not g.reduces_at_end:
            self._flushed_early.add(g.index)
            self._flush(g)

    def tied_grad_arrived(self, g: BlockGroup, index: int, leaf: torch.Tensor) -> None:
        """A tied weight's other use (``runtime.tied``): its gradient into the group's chunk now."""
        self._backward_runs()
        grad, leaf.grad = leaf.grad, None
        g.add_grads([(index, grad)], self.steps_taken, self.mode.step_hypers(), self._room_for_grads)

    def _backward_runs(self) -> None:
        """The first gradient of a backward: ``_backward_done`` is queued to run when it ends."""
        if not self._in_backward:
            if self.updates_started:
                raise RuntimeError(
                    f"backward ran again after the last of grad_accum={self.options.grad_accum} micro-batches, "
                    "before optimizer.step(); pass the right grad_accum to tiertrain.setup or call step() first")
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _flush(self, g: BlockGroup) -> None:
        """A block's gradients are all in: into its grad chunk, or, over several ranks on the last
        micro-batch, reduced. One reduction stays in flight while the next block computes; the one
        before it is finished now (``runtime.reduction``)."""
        g.reduce_grads(self.steps_taken, self.mode.step_hypers(), self._room_for_grads, self.final_micro())
        if g.reducing is None:
            self.mode.grads_final(g)
            return
        self._reducing.append(g)
        while len(self._reducing) > REDUCTIONS_IN_FLIGHT:
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        """The oldest reduction in flight lands; its block's gradients are final."""
        g = self._reducing.pop(0)
        g.finish_reduce()
        self.mode.grads_final(g)

    def _room_for_grads(self, tier: Tier) -> None:
        """With transient gradients, keep at most ``update_workers + 1`` grad chunks alive in ``tier``
        (what the budget check reserved; beside them the rest's, where a tied weight fills it through
        backward in a place of its own: ``_grads_alive``): wait for an update in flight to free one. Host chunks are
        counted from the memory layer, so chunks an update has taken but not yet freed count too; on
        the device (blocks updated in pieces) a block counts while its update runs, which frees them."""
        if not self.transient_grads:
            return
        while self._reducing:  # its chunks count: let it land and its update start, which frees them
            self._finish_reduction()
        while self._grads_alive(tier) > self.plan.update_workers:
            pending = [g.pending for g in self.groups if g.pending is not None and not g.pending.done()]
            if not pending:
                return
            futures.wait(pending, return_when=futures.FIRST_COMPLETED)

    def _grads_alive(self, tier: Tier) -> int:
        rest = self.groups[-1]  # its chunk, held through backward by a tied weight's uses, has a place of its own
        own_place = self.tied_early and grad_tier(rest.plan) is tier
        if tier is Tier.HOST:
            return self.mem.accounting.chunks(Tier.HOST, Kind.GRAD) - (own_place and rest.grads.chunk is not None)
        return sum(1 for g in self.groups if in_pieces(g.plan) and not (own_place and g is rest) and (
            g.grads.chunk is not None or g.local is not None or (g.pending is not None and not g.pending.done())))

    def final_micro(self) -> bool:
        return self.micro + 1 >= self.options.grad_accum

    def params_ready(self, g: BlockGroup) -> None:
        self.mode.params_ready(g)

    def pop_staleness(self) -> int:
        """Lockfree: the most steps a block's params lagged since last asked (0 in the other modes)."""
        pop = getattr(self.mode, "pop_staleness", None)
        return pop() if pop is not None else 0

    def _backward_done(self) -> None:
        late = {g.index for g in self.groups} - self._flushed_early  # flushed here, or not at all
        self._late_flushes, self._flushed_early = late | (self._late_flushes or set()), set()
        for g in self.groups:  # in one order on every rank: those reduced at the end reduce here, always
            if g.grad_count or g.reduces_at_end:
                self._flush(g)
        while self._reducing:
            self._finish_reduction()
        final = self.final_micro()
        self.micro += 1
        self._in_backward = False
        self.mode.backward_done(final)

    # -- optimizer -----------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the true (unscaled) gradients, and the clip coefficient that follows from it."""
        self.last_norm = self._total_norm(norm_type)
        if self.scaler is not None:
            self.last_norm = self.last_norm / self.scaler.scale
        self.clip_coef = clip_coefficient(max_norm, self.last_norm)
        return self.last_norm

    def _total_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm as ``clip_grad_norm_`` computes it, over the gradient chunks. With
        data parallel, sharded blocks' pieces are summed over the ranks (another order than torch's
        per-parameter norms: equal within rounding, not bit for bit)."""
        if self.comm.world_size == 1:
            return total_norm(self._grad_views(lambda g: g.views, self._order), norm_type)
        expert = {id(g.experts) for g in self.groups if g.experts is not None}
        mine = [(g, i) for g, i in self._order if g.shard is not None]
        held = [(g, i) for g, i in self._order if id(g) in expert]
        whole = [(g, i) for g, i in self._order if g.shard is None and id(g) not in expert]
        parts = [(self.comm, self._shard_views(mine))]
        if self.experts is not None:  # experts' gradients: split over the ranks of an expert group
            parts.append((self.experts.a2a, self._grad_views(lambda g: g.views, held)))
        return sharded_norm(parts, self._grad_views(lambda g: g.views, whole), norm_type)

    def _grad_views(self, views_of, order: list[tuple[BlockGroup, int]]) -> list[torch.Tensor]:
        seen: dict[int, list[torch.Tensor]] = {}
        out = []
        for g, i in order:
            if g.grads.has_grad[i]:
                if g.index not in seen:
                    seen[g.index] = views_of(g)(g.grads.chunk)
                out.append(seen[g.index][i])
        return out

    @staticmethod
    def _shard_views(order: list[tuple[BlockGroup, int]]) -> list[torch.Tensor]:
        """This rank's pieces of the sharded blocks' gradients."""
        out, done = [], set()
        for g, _ in order:
            if g.index in done or g.grads.chunk is None:
                continue
            done.add(g.index)
            out += [v for v, i in zip(g.state_views(g.grads.chunk), g.view_params) if g.grads.has_grad[i]]
        return out

    def norm_is_usable(self) -> bool:
        return bool(torch.isfinite(self.last_norm))

    def grad_coefficient(self) -> torch.Tensor | None:
        """What every gradient is multiplied by in the update: the clip coefficient, times 1/scale in
        fp16 (a power of two, so the product rounds exactly as unscaling then clipping would). An fp16
        step whose gradients are not all finite is skipped, as GradScaler skips it, and its scale backs off."""
        if self.scaler is None:
            return self.clip_coef
        if self.clip_coef is None:
            self.last_norm = self._total_norm() / self.scaler.scale
        self.skip_step = not self.norm_is_usable()
        inv = torch.tensor(1.0 / self.scaler.scale)
        self.scaler.update(self.skip_step)
        if self.skip_step:
            for g in self.groups:  # the overflowed gradients are dropped, not carried into the next step
                g.release()
            return None
        return inv if self.clip_coef is None else self.clip_coef * inv

    def step(self) -> None:
        if self.nonfinite_norm:
            raise FloatingPointError(f"the gradient norm is {float(self.last_norm)}: no block was updated; lower "
                                     "the learning rate, or find where the loss or the gradients overflow")
        self.mode.step()

    def restart_reads(self) -> None:
        """A new step: the blocks backward reaches first may be read in during its forward again."""
        self._unread, self._idle_unread = list(self._backward_first), list(self._while_idle)

    def end_step(self) -> None:
        self.clip_coef, self.updates_started, self.skip_step, self.micro = None, False, False, 0

    def wait_updates(self) -> None:
        """Every gradient taken into the states and every state home (checkpoints, the end)."""
        self.mode.wait_all()

    def zero_grad(self) -> None:
        self._reducing.clear()  # left by a backward that raised: let them land and drop them
        self._flushed_early.clear()
        for g in self.groups:
            g.abandon_reduce()
        for g in self.groups:
            for p in g.params:
                p.grad = None
            self.mode.zero_grad(g)
            g.grad_count = 0
        self.micro = 0

    def close(self) -> None:
        self.wait_updates()
        self.mode.close()
        self.comm.close()
        if self.experts is not None:
            self.experts.a2a.close()
            self.experts.replicas.close()
