"""One block's chunks, its state and its step (the counterpart of FSDP2's ``FSDPParamGroup``): the
hooks call ``pre_forward``, ``post_forward``, ``pre_backward`` and ``grad_arrived`` on the group,
backward's end calls ``post_backward`` on those that did not flush as they came, and the update mode
runs ``update`` where it decides. Nothing outside this module sets a group's fields.

Chunks per block (one layout, in parameter order):
  ``master``, ``exp_avg``, ``exp_avg_sq``  fp32 optimizer state at the block's home tier (with data
                  parallel and ``shard``: this rank's shard of them, ``shard`` = its element range);
  ``param_home``  the compute params between uses (a streamed block's, or a sharded block's shard of
                  them): on the host, or the fp32 master itself wherever that lives; fetched (a
                  sharded one: all-gathered) into a device slot before use;
  grads           the gradients gathered since the last update (``grads.GradBuffer``): with data
                  parallel, this rank's part of each micro-batch's gradients once reduced over the
                  ranks, summed over the micro-batches (FSDP2's and ZeRO's default), so no rank keeps a
                  whole block's gradients past the micro-batch that made them;
  stage           data parallel: one micro-batch's gradients of the whole block in the device tier, where
                  backward made them, which the device group reduces (reduce-scatters, for a sharded
                  block) before only this rank's part crosses to the grad chunk (in host memory, reduced
                  over the CPU group, where the device cannot hold it: ``Plan.reduce_on``).
With expert parallel a mixture-of-experts block has two groups, one per parallel pattern: the block's
own (laid out over every rank, as any block) and its held experts' (``experts``, fetched with it:
this rank's experts, whose gradients already hold every rank's tokens, so they are only averaged, and
summed over the experts' replicas where there are any).

Its collaborators come with the run's ``RunContext``, given at construction: the device cache (a
streamed block's slot), the update mode (when params are final enough to use, and what becomes of
final gradients), the state moves (disk-homed states around an update), the backward pass (what one
block's flush means for the others) and the collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from tiertrain.memory import ChunkLayout, Kind, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.heap import release_free_heap
from tiertrain.memory.movement import Handle
from tiertrain.optim import AdamWHyper, adamw_step
from tiertrain.parallel.collectives import Waitable
from tiertrain.parallel.hybrid import Chained
from tiertrain.plan import BlockPlan
from tiertrain.plan.bytes import grad_tier, in_pieces, master_home, state_homes, updated_away
from tiertrain.runtime.blocks import Block
from tiertrain.runtime.grads import GradBuffer, TakenGrads
from tiertrain.runtime.group_state import GRAD_MOVES, PASS_MOVES, SLOT_MOVES, Grads, Pass, Slot, moved
from tiertrain.runtime.pieces import update_in_pieces
from tiertrain.runtime.read_then_gather import ReadThenGather
from tiertrain.runtime.reduction import Copy, Reduction
from tiertrain.runtime.slots import DeviceSlot, point_at

if TYPE_CHECKING:
    from tiertrain.runtime.context import RunContext

F32 = torch.float32
TRIM_AFTER = 8 << 20  # a reduction of this many bytes or more gives its freed buffers back to the OS


@dataclass(frozen=True)
class GroupChunks:
    """A block's chunks as the builder (or a replan) made them: states at their homes, the compute
    params' home between uses (None: its slot is its only copy), and the device slot it computes in."""

    master: Chunk | None              # None in inference-only runs (train=False), as the moments
    exp_avg: Chunk | None
    exp_avg_sq: Chunk | None
    param_home: Chunk | None          # streamed (or sharded) blocks only
    slot: DeviceSlot


@dataclass(frozen=True)
class GroupLayout:
    """How a block is laid out over the ranks and what its gradients are averaged over."""

    shard: tuple[int, int] | None = None   # data parallel, sharded: the elements [start, end) this rank holds
    mean_over: int = 1                     # ranks whose gradients the reduced sum averages
    reduces_at_end: bool = False           # reduced when backward ends, never before (expert replicas: a rank's
    #                                        held experts may get no gradient where a replica's do; a tied weight's
    #                                        other uses, whose gradients are not among those counted to flush early)
    grad_floors: tuple[int, int] = (0, 0)  # bounded gradients: bytes a grad chunk takes at least, and the size
    #                                        kept at the pool's far end
    reduce_on: Tier = Tier.DEVICE          # where a micro-batch's gradients are staged and reduced (``Plan.reduce_on``)
    reduce_dtype: torch.dtype = torch.float32  # what they are summed over the ranks in (``Plan.reduce_dtype``)
    once_a_step: bool = False              # reduced at the step's last micro-batch only (``Plan.reduce_every``)


class BlockGroup:
    def __init__(self, index: int, block: Block, plan: BlockPlan, layout: ChunkLayout, params: list[nn.Parameter],
                 chunks: GroupChunks, steps: list[torch.Tensor], group_of: list[int], compute: torch.dtype,
                 ctx: "RunContext", laid: GroupLayout = GroupLayout(), experts: "BlockGroup | None" = None,
                 comm: Any = None, version: int = 0) -> None:
        """``params``: the slot-backed parameters the module now uses; ``steps``: AdamW's step count per
        parameter (the fused kernel's form); ``group_of``: the optimizer's param group of each parameter;
        ``comm``: the collectives its chunks are laid out over (the run's, or its experts' replicas);
        ``version``: the steps its params already include (a replan's group goes on from its old one's)."""
        self._index, self._block, self._plan, self._layout = index, block, plan, layout
        self._params, self._steps, self._group_of, self._compute = params, steps, group_of, compute
        self._master, self._exp_avg, self._exp_avg_sq = chunks.master, chunks.exp_avg, chunks.exp_avg_sq
        self._param_home, self._slot = chunks.param_home, chunks.slot
        self._ctx, self._mem = ctx, ctx.mem
        self._comm = comm if comm is not None else ctx.comm
        self._shard, self._reduces_at_end, self._floors = laid.shard, laid.reduces_at_end, laid.grad_floors
        self._reduce_on, self._reduce_dtype, self._once_a_step = laid.reduce_on, laid.reduce_dtype, laid.once_a_step
        self._mean_over = laid.mean_over or self._comm.world_size
        self._experts = experts
        self._grads = GradBuffer(len(params))
        self._grad_count = 0                          # parameters whose gradient arrived in the current backward
        self._stage: Chunk | None = None              # data parallel: this micro-batch's gradients, on the device
        self._stage_has = [False] * len(params)
        self._reduction: Reduction | None = None      # data parallel: its gradients' reduction in flight
        self._update: Future | None = None            # its update in flight
        self._version = version                       # the params include the updates of steps < version
        self._master_version = version                # the master does (ahead of the params at a fixed lag)
        self._gathering: Waitable | None = None       # a resident sharded block's gather, started ahead of its forward
        self._pass, self._grad_state, self._slot_state = Pass.IDLE, Grads.NONE, Slot.FRESH
        self._before_forward = Pass.IDLE
        self._view_params, self._cuts = _state_cuts(layout, self._shard)

    # -- what others may read -------------------------------------------------------------
    index = property(lambda self: self._index)
    block = property(lambda self: self._block)
    plan: BlockPlan = property(lambda self: self._plan)  # type: ignore[assignment]
    layout: ChunkLayout = property(lambda self: self._layout)  # type: ignore[assignment]
    params: list[nn.Parameter] = property(lambda self: self._params)  # type: ignore[assignment]
    steps: list[torch.Tensor] = property(lambda self: self._steps)  # type: ignore[assignment]
    group_of: list[int] = property(lambda self: self._group_of)  # type: ignore[assignment]
    compute: torch.dtype = property(lambda self: self._compute)  # type: ignore[assignment]
    master: Chunk | None = property(lambda self: self._master)  # type: ignore[assignment]
    exp_avg: Chunk | None = property(lambda self: self._exp_avg)  # type: ignore[assignment]
    exp_avg_sq: Chunk | None = property(lambda self: self._exp_avg_sq)  # type: ignore[assignment]
    param_home: Chunk | None = property(lambda self: self._param_home)  # type: ignore[assignment]
    slot: DeviceSlot = property(lambda self: self._slot)  # type: ignore[assignment]
    shard: tuple[int, int] | None = property(lambda self: self._shard)  # type: ignore[assignment]
    experts: "BlockGroup | None" = property(lambda self: self._experts)  # type: ignore[assignment]
    comm = property(lambda self: self._comm)
    mem = property(lambda self: self._mem)
    version: int = property(lambda self: self._version)  # type: ignore[assignment]
    reduces_at_end: bool = property(lambda self: self._reduces_at_end)  # type: ignore[assignment]
    reduce_on: Tier = property(lambda self: self._reduce_on)  # type: ignore[assignment]
    mean_over: int = property(lambda self: self._mean_over)  # type: ignore[assignment]
    state = property(lambda self: (self._pass, self._grad_state, self._slot_state))
    view_params: list[int] = property(lambda self: self._view_params)  # type: ignore[assignment]
    state_cuts: list[tuple[int, int]] = property(lambda self: self._cuts)  # type: ignore[assignment]

    # -- the hooks' verbs -------------------------------------------------------------------
    def pre_forward(self) -> None:
        """Its forward is about to run: its params (and its held experts') on the device; then what
        its forward triggers ahead of use for other blocks (the read-ahead)."""
        self._before_forward = Pass.IDLE if self._pass is Pass.FORWARD else self._pass  # FORWARD: one that raised
        self._pass = moved(PASS_MOVES, self.name, self._pass, Pass.FORWARD)
        self.fetch()
        if self._experts is not None:
            self._experts.fetch()
        self._ctx.ahead.forward_began(self)

    def post_forward(self) -> None:
        """Its forward returned: back where it was (a recompute's forward returns inside backward)."""
        self._pass = moved(PASS_MOVES, self.name, self._pass, self._before_forward)

    def pre_backward(self) -> None:
        """Its backward is about to run: a streamed block comes back, and its states start in from disk
        (where the mode reads ahead: not lockfree, whose loop may be moving them). Where its slot was just
        filled from its fp32 master on disk, the master is copied from the slot, not read from disk a
        third time in the step (forward, backward, update)."""
        self._pass = moved(PASS_MOVES, self.name, self._pass, Pass.BACKWARD)
        if self._plan.stream:
            self.fetch()
        ctx = self._ctx
        if ctx.clock.final_micro() and ctx.mode.reads_ahead:
            ctx.moves.read_ahead(self, slot=self._slot if self.fills_slot_from_disk and self._shard is None else None)

    def grad_arrived(self, i: int) -> None:
        """Parameter ``i``'s gradient is accumulated: it moves into the pools at once where
        ``_takes_each_grad`` (autograd's tensor of it lived outside every budget until the whole block's
        had arrived: a 50M-parameter block's 200 MB). Once every one is in, the block flushes."""
        self._ctx.backward.begin()
        if self._takes_each_grad():
            self._take_grad(i)
        self._grad_count += 1
        if self._grad_count == len(self._params) and not self.reduces_at_end:
            self._ctx.backward.flushed_early(self)
            self.post_backward()

    def tied_grad_arrived(self, index: int, leaf: torch.Tensor) -> None:
        """A tied weight's other use (``runtime.tied``): its gradient into the grad chunk now."""
        self._ctx.backward.begin()
        grad, leaf.grad = leaf.grad, None
        self._add_grads([(index, grad)], self._ctx.clock.steps_taken, self._ctx.mode.step_hypers())
        if self._grad_state is Grads.NONE:
            self._grads_to(Grads.SUMMING)

    def in_place_target(self, index: int) -> tuple[torch.Tensor, bool] | None:
        """Where parameter ``index``'s gradient of this backward may be written as it is made
        (``runtime.in_place_grads``): its view in the grad chunk (made now, room made first where
        gradients are bounded) and whether nothing of it is there yet. None where the rest's chunk is
        not filled through backward (``Runtime._tied_grads_early``): autograd's gradient goes the usual way."""
        if not self._ctx.backward.tied_early:
            return None
        if self._grads.chunk is None:
            if updated_away(self._plan):
                self._make_room()
            self._grads.chunk = self._new_grad_chunk(self.nbytes)
        return self.views(self._grads.chunk)[index], not self._grads.has_grad[index]

    def grad_written(self, index: int) -> None:
        """Parameter ``index``'s gradient was written into its ``in_place_target``. It does not count
        towards an early flush: a group written so flushes when backward ends (``reduces_at_end``)."""
        self._ctx.backward.begin()
        self._grads.mark(index, self._ctx.clock.steps_taken, self._ctx.mode.step_hypers())
        if self._grad_state is Grads.NONE:
            self._grads_to(Grads.SUMMING)

    def post_backward(self) -> None:
        """Its gradients of this backward are all in (or backward ended): into its grad chunk, summed
        over the micro-batches; over several ranks their reduction starts first, on every micro-batch (the
        backward pass keeps it in flight under the next block's backward, and the mode learns of them as
        it lands); otherwise the mode learns of them now."""
        ctx = self._ctx
        if self._pass is Pass.BACKWARD:
            self._pass = moved(PASS_MOVES, self.name, self._pass, Pass.IDLE)
        self._reduce_grads(ctx.clock.steps_taken, ctx.mode.step_hypers(), ctx.clock.final_micro())
        if self._reduction is not None:
            ctx.backward.reduction_started(self)
        else:
            ctx.mode.grads_final(self)

    @property
    def has_fresh_grads(self) -> bool:
        """Whether a gradient arrived in this backward that no flush has taken yet."""
        return self._grad_count > 0

    # -- params --------------------------------------------------------------------------------
    def fetch(self) -> None:
        """The block's compute params on the device and usable: a streamed block takes a slot (the
        cache copies or gathers it in, or finds it there); a resident one waits for its update if the
        mode says so, and a sharded one gathers the update's shards into its slot."""
        if self._plan.stream:
            self._ctx.cache.acquire(self)
            return
        self.await_params()
        if self._slot_state is Slot.GATHERING:
            self._gathering.wait()
            self._gathering = None
        elif self._slot_state is Slot.STALE:
            self.gather_into(self._slot.chunk)
        self._slot_state = moved(SLOT_MOVES, self.name, self._slot_state, Slot.FRESH)

    def await_params(self) -> None:
        """Return once its params are final enough to use, as the update mode says."""
        self._ctx.mode.params_ready(self)

    def gather_ahead(self) -> None:
        """A resident sharded block whose slot is stale (or whose update the step left for its next use, run
        here first): start gathering its updated shards now, once its update is final (every rank waits for
        the same update, so every rank issues the same gathers in the same order), so the gather runs while
        the block before it computes."""
        if self._plan.stream:
            return
        if self._slot_state is not Slot.STALE and not self._ctx.mode.update_due(self):
            return
        self.await_params()  # an update the step left for its next use runs now, so its gather can start
        if self._slot_state is not Slot.STALE:
            return
        self._gathering = self.gather_into(self._slot.chunk, async_op=True)
        self._slot_state = moved(SLOT_MOVES, self.name, self._slot_state, Slot.GATHERING)

    def gather_into(self, dst: Chunk, async_op: bool = False) -> Waitable | None:
        """The block's compute params, whole, into ``dst`` (a device slot): every rank's shard of them. This
        rank's shard is first put in its place in the slot (read from disk, or copied from the host), so
        the device group gathers in place, device memory only (NCCL refuses a host shard). A shard on disk
        is read on the read workers, its gather left to ``ReadThenGather`` (at once where not ``async_op``)."""
        dtype = F32 if self._param_home is self._master else self._compute
        out = dst.typed(self._compute)[: self._layout.numel]
        n = self._layout.shard_numel
        src = out[self._shard[0] : self._shard[0] + n]
        self._mem.landed(self._param_home)  # a master on its way to the host (a shared block's): read it there

        if self._param_home.tier is Tier.DISK:  # an fp32 master on disk
            pending = ReadThenGather(self._mem.read_into_async(self._param_home, src.view(torch.uint8)),
                                     lambda: self._comm.all_gather(out, src, async_op=True))
            if async_op:
                return pending
            pending.wait()
            return None
        if self._param_home.tier is not Tier.DEVICE or src.data_ptr() != self._param_home.merge().data_ptr():
            src.copy_(self._param_home.typed(dtype)[:n])  # fp32 master into a compute slot: rounded here
        return self._comm.all_gather(out, src, async_op=async_op)

    def fill(self, slot: DeviceSlot) -> Handle | Waitable:
        """Start filling ``slot`` with its compute params (the device cache moved it there): gathered from
        every rank's shard, or copied from its home. Issued in the thread that runs the step, so every
        rank issues its collectives in one order."""
        if self._slot is not slot:
            self.rebind(slot)
        if self._shard is not None:
            return self.gather_into(slot.chunk, async_op=True)
        return self._mem.mover.copy(self._param_home, slot.chunk)

    def rebind(self, slot: DeviceSlot) -> None:
        """Point its parameters at another slot, the same parameter objects (``slots.point_at``)."""
        point_at(self._params, self._layout, self._compute, slot)
        self._slot = slot

    # -- gradients --------------------------------------------------------------------------
    def release(self) -> None:
        """Drop the gradients gathered for a step that will not update (zero_grad, a skipped fp16 step,
        a backward that raised: a reduction it left in flight is waited for first, since it still
        writes into its stage and its fresh chunk)."""
        self.abandon_reduction()
        for chunk in (self._grads.clear(), self._stage):
            if chunk is not None:
                self._mem.release(chunk)
        self._stage, self._stage_has = None, [False] * len(self._params)
        self._grad_count = 0
        self._grads_to(Grads.NONE)

    def forget_fresh_grads(self) -> None:
        """``zero_grad``: the parameters' gradients not flushed yet are dropped with them."""
        for p in self._params:
            p.grad = None
        self._grad_count = 0

    def _reduce_grads(self, step: int, hypers: list[AdamWHyper] | None, final: bool) -> None:
        """Move the parameters' fresh gradients into the block's grad chunk (accumulating) and free
        them. With data parallel each micro-batch's are averaged over the ranks from its stage (on the
        device, or in host memory: ``Plan.reduce_on``; reduce-scattered to the shards, or all-reduced)
        before this rank's part joins the grad chunk; or, reduced once a step (``Plan.reduce_every``), the
        stage sums the rank's micro-batches and is averaged at the last. The chunk lives where the block's update runs (``plan.bytes.grad_tier``). ``hypers``:
        lockfree keeps the step's own with its gradients."""
        if self._mean_over > 1:
            self._stage_rest()
            self._grads_to(Grads.SUMMING)
            if final or not self._once_a_step:  # else the stage sums this rank's micro-batches until the last
                self._reduce_over_ranks(step, hypers, final)
            self._grad_count = 0
            return
        fresh = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        for p in self._params:
            p.grad = None
        self._add_grads(fresh, step, hypers)
        self._grads_to(Grads.FINAL if final else Grads.SUMMING)
        self._grad_count = 0

    def _add_grads(self, grads: list[tuple[int, torch.Tensor]], step: int, hypers: list[AdamWHyper] | None) -> None:
        """One process: (parameter index, gradient) pairs into the grad chunk, a new one if the update
        took the last (room made first, where gradients are bounded)."""
        fresh = None
        while True:  # a lockfree update loop may take the chunk at any moment between these lines
            with self._grads.lock:
                if self._grads.chunk is None and fresh is not None:
                    self._grads.chunk, fresh = fresh, None
                if self._grads.chunk is not None:
                    self._grads.add(grads, self.views(self._grads.chunk), step, hypers)
                    break
            if updated_away(self._plan):
                self._make_room()  # outside the lock: it may wait for this block's own update
            fresh = self._new_grad_chunk(self.nbytes)
        if fresh is not None:
            self._mem.release(fresh)

    def _takes_each_grad(self) -> bool:
        """Not where an update loop may take the chunk at any moment (lockfree: a loop must see a block's
        gradients of a step whole), nor the rest's where backward does not fill its chunk
        (``tied_early``): its first gradient (the head's) comes as backward starts and its last as it
        ends, so a chunk made at the first would be held through backward and take a block's place
        (bounded gradients, a rank's stage); there the head's waits in autograd, as the planner counts. Nor
        a group reduced when backward ends over several ranks: its stage would live through backward."""
        if self._ctx.mode.takes_grads_any_time:
            return False
        if self._reduces_at_end and self._mean_over > 1:  # a stage held from its first gradient to backward's
            return False                                  # end, beside those the budget counts: not taken early
        return self._block.name != "rest" or self._ctx.backward.tied_early

    def _take_grad(self, i: int) -> None:
        """Parameter ``i``'s gradient out of autograd's tensor, into this rank's sum over micro-batches (data
        parallel) or the grad chunk, summed as a whole block's flush sums it (the same additions, in order)."""
        p = self._params[i]
        grad, p.grad = p.grad, None
        if grad is None:
            return
        if self._mean_over > 1:
            self._stage_one(i, grad)
        else:
            self._add_grads([(i, grad)], self._ctx.clock.steps_taken, self._ctx.mode.step_hypers())
        if self._grad_state is Grads.NONE:
            self._grads_to(Grads.SUMMING)

    def _make_room(self) -> None:
        self._ctx.backward.room_for_grads(grad_tier(self._plan))

    def _stage_rest(self) -> None:
        """This micro-batch's gradients not staged yet into the stage, freed from the params (the stage
        exists afterwards even where none arrived: the ranks' reduction takes every rank's)."""
        self._staged()
        for i, p in enumerate(self._params):
            if p.grad is not None:
                grad, p.grad = p.grad, None
                self._stage_one(i, grad)

    def _stage_one(self, i: int, grad: torch.Tensor) -> None:
        """One parameter's gradient of this micro-batch into the stage (a shared weight's second use adds)."""
        s = self._layout.slots[i]  # its view alone: this runs once per gradient
        view = self._staged().typed(self._reduce_dtype)[s.offset : s.offset + s.numel].view(s.shape)
        if self._stage_has[i]:
            view.add_(grad.to(view.device))  # a GPU's gradient into a host stage: copied first
        else:
            view.copy_(grad)
            self._stage_has[i] = True

    def _staged(self) -> Chunk:
        if self._stage is None:
            nbytes = self._layout.numel * self._reduce_dtype.itemsize
            self._stage = self._mem.allocate(f"{self._block.name}.stage", nbytes, self._reduce_on, Kind.REDUCE,
                                             contiguous=True)
            self._stage.typed(self._reduce_dtype).zero_()  # a parameter no micro-batch reached contributes zeros
        return self._stage

    def _reduce_over_ranks(self, step: int, hypers: list[AdamWHyper] | None, final: bool) -> None:
        """Start averaging the stage over the ranks, on the device group (or the CPU group, for a stage in
        host memory), into this rank's part (its shard reduce-scattered into a device chunk of that size,
        or the whole block all-reduced in place), which is then copied into a fresh grad chunk;
        ``finish_reduction`` adds that to the grad chunk once it has landed. A parameter has a gradient
        where any rank's micro-batch gave it one (flags: host)."""
        if updated_away(self._plan):
            self._make_room()
        rd, side = self._reduce_dtype, self._comm if self._reduce_on is Tier.DEVICE else self._comm.host
        stage = self._staged()
        # every chunk before any collective (if one raises, no rank has issued one), each held by the reduction
        # from then on (a collective that raises leaves them to ``release``)
        fresh = self._new_grad_chunk(self.state_numel * F32.itemsize)
        staged = [stage]
        straight = self._reduce_on is Tier.HOST and rd == F32 and fresh.tier is Tier.HOST  # no part apart
        if self._shard is not None and not straight:
            try:
                staged.append(self._mem.allocate(f"{self._block.name}.reduced", self.state_numel * rd.itemsize,
                                                 self._reduce_on, Kind.REDUCE, contiguous=True))
            except BaseException:
                self._mem.release(fresh)
                raise
        mine, has = fresh.typed(F32)[: self.state_numel], torch.tensor(self._stage_has, dtype=torch.uint8)
        r = Reduction([], fresh, mine, has, step, hypers, final, staged)
        self._reduction, self._stage, self._stage_has = r, None, [False] * len(self._params)
        self._grads_to(Grads.REDUCING)
        r.works.append(self._comm.host.all_reduce(has, op="max", async_op=True))
        full = stage.typed(rd)[: self._layout.numel]
        if self._shard is None:
            r.works += [side.all_reduce(full, async_op=True), Copy(mine, full)]
        elif straight:
            r.works.append(side.reduce_scatter(mine, full, async_op=True))  # straight into the fresh chunk
        else:
            out = staged[1].typed(rd)[: self.state_numel]
            r.works += [side.reduce_scatter(out, full, async_op=True), Copy(mine, out)]  # the shard alone crosses

    def advance_reduction(self) -> None:
        """Start the next collective of the reduction in flight where it has one (hybrid sharding: the
        shard's all-reduce across the nodes once the reduce-scatter inside has landed), not waiting for it."""
        r = self._reduction
        for w in r.works if r is not None else ():
            if isinstance(w, Chained):
                w.advance()

    def abandon_reduction(self) -> None:
        """A reduction left in flight by a backward that raised: let it land (or fail: a lost rank is
        reported where the step raised) and free its chunk; its gradients are dropped."""
        r, self._reduction = self._reduction, None
        if r is None:
            return
        try:
            for w in r.works:
                w.wait()
        except Exception:  # noqa: BLE001 - the error that matters was raised where backward stopped
            pass
        for chunk in (r.fresh, *r.staged):
            self._mem.release(chunk)

    def finish_reduction(self) -> None:
        """Wait for the reduction ``_reduce_over_ranks`` started and add this rank's part, averaged, to
        the grad chunk; after the step's last micro-batch the block's gradients are then final. Nothing
        to do if none is in flight."""
        r, self._reduction = self._reduction, None
        self._land(r)

    def landing_later(self) -> Callable[[], None]:
        """Its reduction in flight taken out of the group (``zero_grad`` and the next backward leave it
        alone), as a call that lands it as ``finish_reduction`` would: the step hands it to the update mode,
        which lands it and updates the block before the block's next use (``BackwardPass.hand_over``)."""
        r, self._reduction = self._reduction, None
        return lambda: self._land(r)

    def land_and_update(self, landing: Callable[[], None], hypers: list[AdamWHyper],
                        coef: torch.Tensor | None) -> None:
        """A reduction ``landing_later`` handed over lands, then the step's update of the block, in the calling
        thread (the step's, at the block's next use; or an update worker)."""
        landing()
        self.update_now(hypers, coef)

    def _land(self, r: Reduction | None) -> None:
        if r is None:
            return
        for w in r.works:
            w.wait()
        r.mine.div_(self._mean_over)
        fresh = r.fresh
        with self._grads.lock:
            if self._grads.chunk is None:
                self._grads.chunk, fresh = fresh, None
            else:
                self._grads.chunk.typed(F32)[: self.state_numel].add_(r.mine)
            self._grads.has_grad = [a or bool(b) for a, b in zip(self._grads.has_grad, r.has.tolist())]
            self._grads.step, self._grads.hypers = r.step, r.hypers
        for chunk in (fresh, *r.staged):
            if chunk is not None:
                self._mem.release(chunk)
        self._grads_to(Grads.FINAL if r.final else Grads.SUMMING)
        if self.nbytes >= TRIM_AFTER:
            release_free_heap()  # the transport's buffers for a large chunk, freed, would stay in its threads' heaps

    def _new_grad_chunk(self, nbytes: int) -> Chunk:
        mine, top = self._floors  # bounded gradients: sizes that never fragment (``plan.bytes.grad_floors``)
        at_top = nbytes == top
        if not at_top:
            nbytes = max(nbytes, mine)
        return self._mem.allocate(f"{self._block.name}.grad", nbytes, grad_tier(self._plan), Kind.GRAD,
                                  contiguous=True, top=at_top)

    def _grads_to(self, new: Grads) -> None:
        self._grad_state = moved(GRAD_MOVES, self.name, self._grad_state, new)

    # -- what the gradients hold (the norm, the room they take) ------------------------------
    def grad_views(self) -> list[torch.Tensor | None]:
        """Per parameter, an fp32 view of its gradient in the grad chunk (None: it got none)."""
        chunk = self._grads.chunk
        if chunk is None:
            return [None] * len(self._params)
        views = self.views(chunk)
        return [v if has else None for v, has in zip(views, self._grads.has_grad)]

    def shard_grad_pieces(self) -> list[tuple[torch.Tensor, int]]:
        """This rank's pieces of its gradients (a sharded block), those of parameters that got one, each with
        its parameter's index."""
        chunk = self._grads.chunk
        if chunk is None:
            return []
        return [(v, i) for v, i in zip(self.state_views(chunk), self._view_params) if self._grads.has_grad[i]]

    def grad_piece(self, i: int) -> tuple[torch.Tensor, int] | None:
        """This rank's piece of parameter ``i``'s final gradient, an fp32 view into the grad chunk (flat), and
        where the piece starts in the flattened parameter: the whole of it, or its part in this rank's shard;
        None where the rank holds none of it or it got no gradient."""
        chunk = self._grads.chunk
        if chunk is None or not self._grads.has_grad[i]:
            return None
        if self._shard is None:
            return self.views(chunk)[i].view(-1), 0
        for (lo, hi), owner in zip(self._cuts, self._view_params):
            if owner == i:
                return chunk.typed(F32)[lo:hi], self._shard[0] + lo - self._layout.slots[i].offset
        return None

    def holds_grads(self) -> bool:
        """Whether any gradient chunk of its is alive (its stage, the grad chunk) or its update runs."""
        return self._grads.chunk is not None or self._stage is not None or not self.update_idle()

    def holds_grad_chunk(self) -> bool:
        return self._grads.chunk is not None

    def grads_span(self, steps: int) -> bool:
        """Whether its gathered gradients span ``steps`` steps its params do not include yet (lockfree's
        loop coalesces disk passes so). Call under ``grad_lock``."""
        return self._grads.chunk is not None and self._grads.step + 1 - self._version >= steps

    @property
    def grad_lock(self) -> Any:
        return self._grads.lock

    # -- the update ----------------------------------------------------------------------------
    def update(self, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
        """Update the block where the calling thread runs: its states in, AdamW, its params published,
        its states home (a block updated in pieces does all of it a piece at a time)."""
        if in_pieces(self._plan):
            taken = self._grads.take()
            if taken is not None:
                update_in_pieces(self, taken, hypers, coef)
                self._published(taken.step)
            return
        moves = self._ctx.moves
        moves.bring_in(self)
        self._apply(hypers, coef)
        moves.send_home(self)

    def _apply(self, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
        """Apply the gathered gradients to master and moments (which must be in memory), free the
        gradients, publish the new compute params, and note the step they now include."""
        self._apply_taken(self._grads.take(), hypers, coef)
        self._publish()
        self._version = self._master_version

    # -- at a fixed lag (``runtime.modes.fixed_lag``): the params a step behind the master ------------
    def publish_and_take(self) -> TakenGrads | None:
        """The master's params (the update before's) into the compute copy, and the step's gradients taken
        (the next backward's go into a chunk of their own): what the block's next forward waits for. The
        master must be in memory (``update_lagged`` brings in one that is not)."""
        if in_pieces(self._plan):
            raise RuntimeError(f"{self.name} is updated in pieces, which a fixed lag refuses: a bug in tiertrain")
        self._publish()
        self._version = self._master_version
        return self._grads.take()

    def update_taken(self, taken: TakenGrads | None, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
        """AdamW of ``taken`` into the master alone, which the params no longer read (its states in, and home)."""
        moves = self._ctx.moves
        moves.bring_in(self)
        self._apply_taken(taken, hypers, coef)
        moves.send_home(self)

    def update_lagged(self, hypers: list[AdamWHyper], coef: torch.Tensor | None,
                      published: Callable[[], None]) -> None:
        """Both halves in the calling thread, for a master that lives on disk: its states in, the master's
        params published, the gradients taken, ``published`` called, AdamW, its states home."""
        moves = self._ctx.moves
        moves.bring_in(self)
        taken = self.publish_and_take()
        published()
        self._apply_taken(taken, hypers, coef)
        moves.send_home(self)

    def _apply_taken(self, taken: TakenGrads | None, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
        """AdamW of ``taken`` into master and moments (in memory), its chunk freed (gradients live from
        backward's flush to here), and the step the master now includes noted."""
        if taken is not None:
            adamw_block(self, taken.hypers or hypers, coef, taken)
            self._mem.release(taken.chunk)
            self._master_version = max(self._master_version, taken.step + 1)

    def _publish(self) -> None:
        """Write the fp32 master into the compute copy the next forward reads (rounded to the compute
        dtype), and let the cache (or, for a resident sharded block, its next fetch) know a slot's copy
        of it is stale."""
        target = self._param_home if self._param_home is not None else self._slot.chunk
        if target is not self._master:  # an fp32 master doubles as the param home of a streamed block
            n = self.state_numel
            target.typed(self._compute)[:n].copy_(self._master.typed(F32)[:n])
        self._mark_written()

    def _published(self, step: int) -> None:
        """A block updated in pieces published its new params piece by piece (``runtime.pieces``)."""
        self._mark_written()
        self._version = self._master_version = max(self._version, step + 1)

    def _mark_written(self) -> None:
        if self._shard is not None and not self._plan.stream:
            self._slot_state = moved(SLOT_MOVES, self.name, self._slot_state, Slot.STALE)
        self._ctx.cache.invalidate(self)

    def params_written(self) -> None:
        """Its params were written from outside a step (a checkpoint loaded): the next use reads them anew."""
        self._ctx.cache.invalidate(self)

    def shard_written(self) -> None:
        """Its shard alone was written from outside a step (a sharded checkpoint read by parts): a resident
        block's slot gathers every rank's at its next use, a streamed one's at its next fetch."""
        self._mark_written()

    def update_now(self, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
        """The step's update of the block in this (the step's) thread: its gradients are handed over."""
        self._handed_over()
        self.update(hypers, coef)

    def run_update(self, pool: Executor, fn: Callable[..., None], *args: Any) -> Future:
        """``fn(*args)`` on ``pool`` as its update in flight (its gradients handed over to it): its next
        use waits for it."""
        self._update = pool.submit(fn, *args)
        self._handed_over()
        return self._update

    def _handed_over(self) -> None:
        """Its gradients belong to an update now (which takes them when it runs)."""
        if self._grad_state is not Grads.REDUCING:
            self._grads_to(Grads.NONE)

    @property
    def update_future(self) -> Future | None:
        return self._update

    def update_idle(self) -> bool:
        """No update of its runs or waits."""
        return self._update is None or self._update.done()

    def wait_update(self) -> None:
        """Wait for its update in flight (re-raising its error here)."""
        if self._update is not None:
            self._update.result()

    def finish_update(self) -> None:
        """Wait for its update in flight and forget it."""
        if self._update is not None:
            self._update.result()
            self._update = None

    def steps_on(self, device: torch.device) -> None:
        """Fused AdamW wants each step count on its parameter's device (torch's CUDA kernel refuses CPU
        counts): a block whose master is homed on the GPU keeps its counts there, moved at its first
        update (and back to the host for an update in pieces)."""
        if self._steps and self._steps[0].device != device:
            self._steps[:] = [s.to(device) for s in self._steps]

    # -- sizes and views ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._block.name

    @property
    def states(self) -> tuple[Chunk, Chunk, Chunk]:
        return self._master, self._exp_avg, self._exp_avg_sq

    @property
    def state_numel(self) -> int:
        """Elements of this rank's states (its shard, or the whole block)."""
        return self._layout.numel if self._shard is None else self._shard[1] - self._shard[0]

    @property
    def on_disk(self) -> list[Chunk]:
        """The states that live on disk between steps (``plan.bytes.state_homes``), which cross to the
        host for each update and back; a ``host_master`` block's master stays where it is."""
        return [c for c, home in zip(self.states, state_homes(self._plan)) if home is Tier.DISK]

    @property
    def fills_slot_from_disk(self) -> bool:
        """A streamed fp32 block without a param home of its own whose master travels between disk and
        host: its slot is copied from that master, so the master must stay put (its write-back landed,
        no read in) while the slot is filled."""
        return (self._param_home is not None and self._param_home is self._master
                and master_home(self._plan) is Tier.DISK)

    @property
    def nbytes(self) -> int:
        return self._layout.numel * F32.itemsize

    def views(self, chunk: Chunk, dtype: torch.dtype = F32) -> list[torch.Tensor]:
        """Per-parameter views (fp32, or ``dtype``) of a whole-block chunk (merged) in layout order."""
        flat = chunk.typed(dtype)
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self._layout.slots]

    def state_views(self, chunk: Chunk) -> list[torch.Tensor]:
        """fp32 views of a state chunk, one per piece of a parameter this rank holds (``view_params``
        names the parameter of each): per parameter, or its sharded pieces."""
        flat = chunk.typed(F32)
        return [flat[lo:hi] for lo, hi in self._cuts]

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk it owns now (states, param home, slot), each once."""
        seen: set[int] = set()
        for c in (*self.states, self._param_home, self._slot.chunk):
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                yield c


def _state_cuts(layout: ChunkLayout, shard: tuple[int, int] | None) -> tuple[list[int], list[tuple[int, int]]]:
    """(parameter of each piece, [lo, hi) of each piece within a state chunk): each parameter whole,
    or where a shard holds part of it, that part."""
    if shard is None:
        return list(range(len(layout.slots))), [(s.offset, s.offset + s.numel) for s in layout.slots]
    start, end = shard
    owners, cuts = [], []
    for i, s in enumerate(layout.slots):
        lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
        if lo < hi:
            owners.append(i)
            cuts.append((lo - start, hi - start))
    return owners, cuts


def adamw_block(group: BlockGroup, hypers: list[AdamWHyper], coef: torch.Tensor | None, taken: TakenGrads) -> None:
    """One AdamW step of the block's master and moments (this rank's pieces) with the gradients it took."""
    owners = group.view_params
    views = group.views if group.shard is None else group.state_views
    masters = views(group.master)
    if masters:  # a shard may hold no piece of this block
        group.steps_on(masters[0].device)
    adamw_step(masters, views(taken.chunk), views(group.exp_avg), views(group.exp_avg_sq),
               [group.steps[i] for i in owners], [taken.has_grad[i] for i in owners],
               [group.group_of[i] for i in owners], hypers, coef)
