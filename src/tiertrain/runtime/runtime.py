"""Wires one model to the memory layer under a plan: block states, the device cache, hooks, updates."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import torch
import torch.nn as nn

from tiertrain.memory import MemorySystem, Tier
from tiertrain.optim.adamw import clip_coefficient, total_grad_norm
from tiertrain.optim.updater import Updater
from tiertrain.runtime.block_state import BlockState, Slot, build_state, install_params
from tiertrain.runtime.blocks import find_blocks
from tiertrain.runtime.hooks import flush_grads, install_block_hooks, install_grad_hooks
from tiertrain.runtime.loss_scale import LossScaler
from tiertrain.plan import Plan
from tiertrain.plan_bytes import master_in_slot, separate_param_home, steps_per_disk_pass
from tiertrain.runtime.cache import DeviceCache
from tiertrain.memory.tiers import Kind


class Runtime:
    def __init__(self, model: nn.Module, groups: list[dict[str, Any]], group_of_param: dict[int, int],
                 mem: MemorySystem, plan: Plan, grad_accum: int, max_grad_norm: float | None,
                 blocks_path: str | None = None, train: bool = True, bound_grads: bool = True,
                 init_states: bool = True) -> None:
        self.model, self.mem, self.plan = model, mem, plan
        self.groups, self.grad_accum, self.max_grad_norm = groups, grad_accum, max_grad_norm
        blocks = find_blocks(model, blocks_path)
        plans = list(plan.blocks) + [plan.rest]
        ring = self._ring_slots(blocks, plans)
        self.states: list[BlockState] = []
        streamed_seen = 0
        for i, (block, bplan) in enumerate(zip(blocks, plans)):
            if bplan.stream:
                slot = ring[streamed_seen % len(ring)]
                streamed_seen += 1
            else:
                slot = Slot(mem.allocate(f"{block.name}.slot", _nbytes(block, plan.compute), Tier.DEVICE, Kind.PARAM,
                                         contiguous=True))
            group_of = [group_of_param.get(id(p), 0) for _, p in block.params]
            self.states.append(build_state(mem, i, block, bplan, slot, group_of, train,
                                           own_param_home=separate_param_home(bplan, plan, train),
                                           compute=plan.compute, master_in_slot=master_in_slot(bplan, plan, train),
                                           init=init_states))
        for st in self.states:
            install_params(model, st)
            if train:
                install_grad_hooks(self, st)
            if st.block.module is not None:
                install_block_hooks(self, st)
        self.updater = Updater(mem, groups, lambda st: self.cache.invalidate(st), workers=plan.update_workers,
                               read_ahead=plan.read_ahead)
        self.cache = DeviceCache([s for s in self.states if s.plan.stream], ring, mem.mover, plan.prefetch,
                                 ready=self.params_ready)
        self.steps_taken = 0         # optimizer steps the user has taken
        self.staleness_seen = 0      # lockfree: the most steps a block's params lagged since last asked
        self._order = self._model_order()
        # disk-homed blocks in the order backward reaches them (the rest has no hook), whose states
        # may be read during forward: not those whose slot is filled from the master itself
        self._backward_first = [s for s in self.states[-2::-1]
                                if s.plan.home is Tier.DISK and not s.fills_slot_from_master]
        self._unread = list(self._backward_first)  # of those, the ones this step has not read in yet
        self._in_backward = False
        self.micro = 0               # backward passes in the current accumulation window
        self.last_norm: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None
        self.updates_started = False
        self.skip_step = False       # fp16: this step's gradients overflowed; no block is updated
        self.nonfinite_norm = False  # overlap with clipping: the norm was NaN/inf, so no update was started
        self.scaler = LossScaler() if train and plan.compute_dtype == "fp16" else None
        # clipping and fp16 overflow checks need every gradient of the step before any update
        self.needs_all_grads = max_grad_norm is not None or self.scaler is not None
        # overlap updates each block's gradients away as they come; where the host budget cannot hold
        # them all, backward waits for the optimizer to free a grad chunk (``bound_grads``)
        self.transient_grads = (bound_grads and train and plan.update == "overlap" and not self.needs_all_grads
                                and grad_accum == 1)

    def _ring_slots(self, blocks, plans) -> list[Slot]:
        streamed = [b for b, p in zip(blocks, plans) if p.stream]
        if not streamed:
            return []
        size = max(_nbytes(b, self.plan.compute) for b in streamed)
        return [Slot(self.mem.allocate(f"slot.{k}", size, Tier.DEVICE, Kind.PARAM, contiguous=True))
                for k in range(min(self.plan.window + self.plan.cache, len(streamed)))]

    def _model_order(self) -> list[tuple[BlockState, int]]:
        """(state, index) of every parameter in ``model.parameters()`` order, as clip_grad_norm_ sees them."""
        where = {id(p): (st, i) for st in self.states for i, p in enumerate(st.params)}
        return [where[id(p)] for p in self.model.parameters() if id(p) in where]

    # -- forward -----------------------------------------------------------------------
    def forward_begins(self, st: BlockState) -> None:
        """A block's forward is about to run: its params must be there. Then the states of the
        blocks whose backward comes first start coming in from disk as soon as their last
        write-back has landed, so the disk keeps working through the forward, where it would
        otherwise wait for backward's first trigger."""
        if st.plan.stream:
            self.cache.acquire(st)
        else:
            self.params_ready(st)
        if self._final_micro() and self.plan.update != "lockfree":
            started = set()
            for first in self._unread:
                if self.updater.reading_full():
                    break
                if self.updater.read_ahead(first, block=False):
                    started.add(first.index)
            self._unread = [s for s in self._unread if s.index not in started]

    # -- backward ----------------------------------------------------------------------
    def backward_begins(self, st: BlockState) -> None:
        """A block's backward is about to run: bring its params back, start reading its states.

        Not in lockfree mode: there a block's update loop may be moving its states at this very
        moment (a chunk has one mover at a time), and nothing waits for those reads anyway."""
        if st.plan.stream:
            self.cache.acquire(st)
        if self._final_micro() and self.plan.update != "lockfree":
            self.updater.read_ahead(st)

    def grad_arrived(self, st: BlockState) -> None:
        if not self._in_backward:
            if self.updates_started:
                raise RuntimeError(
                    f"backward ran again after the last of grad_accum={self.grad_accum} micro-batches, before "
                    "optimizer.step(); pass the right grad_accum to tiertrain.setup or call step() first")
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        st.grad_count += 1
        if st.grad_count == len(st.params):
            flush_grads(st, self.mem, self._room_for_grads, self.steps_taken, self._step_groups())
            self._maybe_update_now(st)

    def _step_groups(self) -> list[dict[str, Any]] | None:
        """Lockfree: this step's hyperparameters, kept with its gradients (an update loop may apply
        them after the training loop has moved the learning rate on to the next step's)."""
        return [dict(g) for g in self.groups] if self.plan.update == "lockfree" else None

    def _room_for_grads(self) -> None:
        """With transient gradients, keep at most ``update_workers + 1`` grad chunks alive (what the
        budget check reserved): wait for an update in flight to free one. Counted from the memory
        layer, so chunks an update has taken but not yet freed count too."""
        if not self.transient_grads:
            return
        while self.mem.accounting.chunks(Tier.HOST, Kind.GRAD) > self.plan.update_workers:
            pending = [st.pending_update.future for st in self.states
                       if st.pending_update is not None and not st.pending_update.done()]
            if not pending:
                return
            futures.wait(pending, return_when=futures.FIRST_COMPLETED)

    def _final_micro(self) -> bool:
        return self.micro + 1 >= self.grad_accum

    def params_ready(self, st: BlockState) -> None:
        """Return when the block's params may be used: after its update is written back, or in
        lockfree mode once they are at most ``max_staleness`` steps old (the staleness is recorded)."""
        if self.plan.update != "lockfree":
            self.updater.settle_block(st)
            return
        while self.steps_taken - st.version > self.plan.max_staleness:
            self.updater.submit_loop(st)  # the gradients it holds back must be applied now
            pending = st.pending_update
            if pending is None:
                break
            pending.wait()
            if pending is st.pending_update and self.steps_taken - st.version > self.plan.max_staleness:
                break  # its loop ended without the missing step's gradients (none were produced)
        self.staleness_seen = max(self.staleness_seen, self.steps_taken - st.version)

    def pop_staleness(self) -> int:
        seen, self.staleness_seen = self.staleness_seen, 0
        return seen

    def _maybe_update_now(self, st: BlockState) -> None:
        """Overlap without clipping: a block's update starts as soon as its last gradient is in.
        Lockfree: an update loop takes whatever gradients have gathered, never blocking backward."""
        if self.plan.update == "lockfree":
            # a disk-homed block's pass costs its states' disk traffic whatever it carries: where the
            # staleness allows, it takes several steps' gradients per pass. Elsewhere a pass is cheap
            # and fewer of them would only mean fewer updates
            steps = steps_per_disk_pass(self.plan.update, self.plan.max_staleness)
            self.updater.submit_loop(st, coalesce=steps if st.plan.home is Tier.DISK else 1)
            return
        if self.plan.update == "overlap" and not self.needs_all_grads and self._final_micro():
            self.updater.submit(st, None)
            self.updates_started = True

    def _backward_done(self) -> None:
        for st in self.states:
            if st.grad_count:
                flush_grads(st, self.mem, self._room_for_grads, self.steps_taken, self._step_groups())
                self._maybe_update_now(st)
        final = self._final_micro()
        self.micro += 1
        self._in_backward = False
        if final and self.plan.update == "overlap" and self.needs_all_grads:
            if self.max_grad_norm is not None:
                self.clip_grad_norm_(self.max_grad_norm)
                if self.scaler is None and not bool(torch.isfinite(self.last_norm)):
                    self.nonfinite_norm = True  # updating would write NaN into every master: none starts
                    self.updates_started = True
                    return
            coef = self._grad_coefficient()
            if not self.skip_step:
                for st in self.states[-1:] + self.states[:-1]:  # rest (embeddings) first: the next forward starts there
                    self.updater.submit(st, coef)
            self.updates_started = True

    # -- optimizer -----------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the true (unscaled) gradients, and the clip coefficient that follows from it."""
        self.last_norm = total_grad_norm(self._order, norm_type)
        if self.scaler is not None:
            self.last_norm = self.last_norm / self.scaler.scale
        self.clip_coef = clip_coefficient(max_norm, self.last_norm)
        return self.last_norm

    def _grad_coefficient(self) -> torch.Tensor | None:
        """What every gradient is multiplied by in the update: the clip coefficient, times 1/scale in
        fp16 (a power of two, so the product rounds exactly as unscaling then clipping would). An fp16
        step whose gradients are not all finite is skipped, as GradScaler skips it, and its scale backs off."""
        if self.scaler is None:
            return self.clip_coef
        if self.clip_coef is None:
            self.last_norm = total_grad_norm(self._order) / self.scaler.scale
        self.skip_step = not bool(torch.isfinite(self.last_norm))
        inv = torch.tensor(1.0 / self.scaler.scale)
        self.scaler.update(self.skip_step)
        if self.skip_step:
            for st in self.states:  # the overflowed gradients are dropped, not carried into the next step
                taken = st.take_grads()
                if taken is not None:
                    self.mem.release(taken.chunk)
            return None
        return inv if self.clip_coef is None else self.clip_coef * inv

    def step(self) -> None:
        if self.nonfinite_norm:
            raise FloatingPointError(f"the gradient norm is {float(self.last_norm)}: no block was updated; lower "
                                     "the learning rate, or find where the loss or the gradients overflow")
        self.steps_taken += 1
        if self.plan.update == "lockfree":  # updates are already running; the device does not wait
            self.micro = 0
            return
        self.cache.settle()
        self._unread = list(self._backward_first)
        if not self.updates_started:
            coef = self._grad_coefficient()
            for st in self.states[-1:] + self.states[:-1]:
                if not self.skip_step:
                    self.updater.update(st, coef)
        if self.plan.update == "sync":
            self.wait_updates()
        self.clip_coef, self.updates_started, self.skip_step, self.micro = None, False, False, 0

    def wait_updates(self) -> None:
        """Every gradient taken into the states and every state home (checkpoints, the end)."""
        if self.plan.update == "lockfree":
            for st in self.states:
                self.updater.submit_loop(st)  # what the loops held back to coalesce
        for st in self.states:
            if st.pending_update is not None:
                st.pending_update.wait()
                st.pending_update = None
        self.updater.drain()

    def zero_grad(self) -> None:
        for st in self.states:
            for p in st.params:
                p.grad = None
            if self.plan.update == "lockfree":
                continue  # flushed gradients belong to the optimizer's loop now
            if st.pending_update is None:  # a pending update resets the flags itself when done
                st.has_grad = [False] * len(st.params)
                if st.grad is not None:
                    self.mem.release(st.grad)
                    st.grad = None
            st.grad_count = 0
        self.micro = 0

    def close(self) -> None:
        self.wait_updates()
        self.updater.close()


def _nbytes(block, dtype: torch.dtype) -> int:
    from tiertrain.memory import ChunkLayout

    return ChunkLayout.build([(n, tuple(p.shape)) for n, p in block.params]).numel * dtype.itemsize
