"""One backward pass over every block group: what a block's flush means for the others.

A group flushes itself when its last gradient arrives (``BlockGroup.grad_arrived``); what spans the
groups lives here. Its first gradient queues ``_done`` for when autograd's backward ends, which
flushes the groups that did not flush as they came (parameters that got no gradient, an idle
expert; groups reduced at the end) and lands every reduction. Over several ranks one reduction stays
in flight while the next block computes (two with hybrid sharding: a shard's all-reduce across the
nodes, started as the next reduction starts, runs under the block after), and the oldest is finished
when a new one would pass that count (``runtime.reduction``). Where the host cannot hold every block's gradients (bounded gradients),
a flush waits here for an update in flight to free a chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING

import torch

from tiertrain.memory import Kind, MemorySystem, Tier
from tiertrain.plan.bytes import REDUCTIONS_IN_FLIGHT, grad_tier, in_pieces
from tiertrain.runtime.step_clock import StepClock

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup
    from tiertrain.runtime.modes.base import UpdateMode



class BackwardPass:
    def __init__(self, groups: list["BlockGroup"], clock: StepClock, mode: "UpdateMode", mem: MemorySystem,
                 bounded: bool, update_workers: int, tied_early: bool, late: set[int] | None = None,
                 in_flight: int = REDUCTIONS_IN_FLIGHT, lands_at_step: bool = False) -> None:
        """``bounded``: backward waits for updates to free gradient chunks, keeping ``update_workers + 1``
        alive per tier; ``tied_early``: the rest's chunk, which a tied weight's other uses fill through
        backward, has a place of its own there (``Runtime._tied_grads_early``); ``late``: the blocks an
        earlier plan's backwards saw flush only as backward ended; ``in_flight``: reductions kept in
        flight beside the one starting (``plan.bytes.reductions_in_flight``, what the budget counts);
        ``lands_at_step``: gradients reduced once a step (``Plan.reduce_every``) are all left in flight by the
        last micro-batch's backward: FOLD3D's DP.sync, running under whatever the rank computes next (the
        backward of a pipeline's earlier segments), landing at the step (``land``) or, where the step may
        leave them, at each block's next use (``hand_over``)."""
        self._groups, self._clock, self._mode, self._mem = groups, clock, mode, mem
        self._in_flight, self.lands_at_step = (len(groups) if lands_at_step else in_flight), lands_at_step
        self._bounded, self._workers, self.tied_early = bounded, update_workers, tied_early
        self.running = False                    # a backward runs now
        self.late_flushes = late                # blocks a backward did not flush as they came (None: none ran yet)
        self._flushed_early: set[int] = set()   # blocks this backward flushed as their gradients came in
        self._reducing: list["BlockGroup"] = []  # blocks whose gradients' reduction is in flight, oldest first

    def begin(self) -> None:
        """A gradient arrived: the first of a backward queues ``_done`` to run when it ends."""
        if self.running:
            return
        if self._clock.updates_started or self._reducing:  # the step's last reductions still wait for it
            raise RuntimeError(
                f"backward ran again after the last of grad_accum={self._clock.grad_accum} micro-batches, "
                "before optimizer.step(); pass the right grad_accum to tiertrain.setup or call step() first")
        self.running = True
        torch.autograd.Variable._execution_engine.queue_callback(self._done)

    def flushed_early(self, g: "BlockGroup") -> None:
        self._flushed_early.add(g.index)

    def reduction_started(self, g: "BlockGroup") -> None:
        """``g``'s reduction is in flight: the ones before it take their next collective (hybrid sharding's
        all-reduce across nodes), and the oldest lands where more than ``in_flight`` are under way."""
        for older in self._reducing:
            older.advance_reduction()
        self._reducing.append(g)
        while len(self._reducing) > self._in_flight:
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        """The oldest reduction in flight lands; its block's gradients are final."""
        g = self._reducing.pop(0)
        began = time.perf_counter()
        g.finish_reduction()
        self._clock.sync_wait_s += time.perf_counter() - began
        self._mode.grads_final(g)

    def room_for_grads(self, tier: Tier) -> None:
        """With bounded gradients, keep at most ``update_workers + 1`` grad chunks alive in ``tier``
        (what the budget check reserved; beside them the rest's, where a tied weight fills it through
        backward in a place of its own: ``_grads_alive``): wait for an update in flight to free one. Host
        chunks are counted from the memory layer, so chunks an update has taken but not yet freed count
        too; on the device (blocks updated in pieces) a block counts while its update runs, which frees them."""
        if not self._bounded:
            return
        while self._reducing:  # its chunks count: let it land and its update start, which frees them
            self._finish_reduction()
        while self._grads_alive(tier) > self._workers:
            pending = [g.update_future for g in self._groups if not g.update_idle()]
            if not pending:
                return
            futures.wait(pending, return_when=futures.FIRST_COMPLETED)

    def _grads_alive(self, tier: Tier) -> int:
        rest = self._groups[-1]  # its chunk, held through backward by a tied weight's uses, has a place of its own
        own_place = self.tied_early and grad_tier(rest.plan) is tier
        if tier is Tier.HOST:
            return self._mem.accounting.chunks(Tier.HOST, Kind.GRAD) - (own_place and rest.holds_grad_chunk())
        return sum(1 for g in self._groups
                   if in_pieces(g.plan) and not (own_place and g is rest) and g.holds_grads())

    def _done(self) -> None:
        """Backward ended (autograd's callback): flush what did not flush as it came, in one order on every
        rank (those reduced at the end reduce here, always), land every reduction, count the micro-batch."""
        late = {g.index for g in self._groups} - self._flushed_early
        self.late_flushes, self._flushed_early = late | (self.late_flushes or set()), set()
        for g in self._groups:
            if g.has_fresh_grads or g.reduces_at_end:
                g.post_backward()
        final = self._clock.final_micro()
        if not (final and self.lands_at_step):
            self._land_all()
        self._clock.micro += 1
        self.running = False
        self._mode.backward_done(final)

    def land(self) -> None:
        """Every reduction in flight landed, oldest first (its block's gradients final). Not those of a
        backward that raised before it ended: ``zero_grad`` drops them (``abandon``)."""
        if not self.running:
            self._land_all()

    def hand_over(self) -> dict[int, Callable[[], None]]:
        """FOLD3D's DP.sync landing under the next forward (Alg. 1 line 5, Alg. 2's forward part): every
        reduction the step's last backward left in flight, taken from the blocks as calls that land them (by
        block index), for the update mode to land each, and update its block, before the block's next use.
        A block the next forward reaches late (a later segment's, or deep in the stage) finds its reduction
        landed under the forward before it; the step itself waits for none."""
        if self.running:
            return {}
        later = {g.index: g.landing_later() for g in self._reducing}
        self._reducing.clear()
        return later

    def _land_all(self) -> None:
        while self._reducing:
            self._finish_reduction()

    def abandon(self) -> None:
        """``zero_grad`` after a backward that raised: the reductions it left in flight are the groups' to
        land and drop (``BlockGroup.abandon_reduction``)."""
        self._reducing.clear()
        self._flushed_early.clear()
        self.running = False  # a backward that raised never reached ``_done``: the next one begins afresh
