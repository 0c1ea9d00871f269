"""One block's chunks and gradient bookkeeping, behind the verbs a step uses (the counterpart of
FSDP2's ``FSDPParamGroup``): ``fetch`` its compute params onto the device, ``release`` what it
holds for the step, ``reduce_grads`` as backward finishes it, ``update`` its states.

Chunks per block (one layout, in parameter order):
  ``master``, ``exp_avg``, ``exp_avg_sq``  fp32 optimizer state at the block's home tier (with data
                  parallel and ``shard``: this rank's shard of them, ``shard`` = its element range);
  ``param_home``  the compute params between uses (a streamed block's, or a sharded block's shard of
                  them): on the host, or the fp32 master itself wherever that lives; fetched (a
                  sharded one: all-gathered) into a device slot before use;
  ``grads``       the gradients gathered since the last update (``grads.GradBuffer``), reduced over
                  the ranks (``local``: this rank's own, summed over micro-batches, until then).
With expert parallel a mixture-of-experts block has two groups, one per parallel pattern: the block's
own (laid out over every rank, as any block) and its held experts' (``experts``: this rank's experts,
whose gradients already hold every rank's tokens, so they are only averaged, and summed over the
experts' replicas where there are any).
Who waits for what (an update in flight, a slot's copy, a disk read) is decided by the update
mode and the device cache the runtime wires in; a group only does what is asked of it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tiertrain.memory import ChunkLayout, Kind, MemorySystem, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.heap import release_free_heap
from tiertrain.optim import AdamWHyper, adamw_step
from tiertrain.parallel import Collectives
from tiertrain.parallel.collectives import Waitable
from tiertrain.plan import BlockPlan
from tiertrain.plan.bytes import grad_tier, master_home, state_homes, updated_away
from tiertrain.runtime.blocks import Block
from tiertrain.runtime.grads import GradBuffer, TakenGrads
from tiertrain.runtime.reduction import Copy, Reduction
from tiertrain.runtime.slots import Slot

F32 = torch.float32
TRIM_AFTER = 8 << 20  # a reduction of this many bytes or more gives its freed buffers back to the OS


@dataclass(eq=False)
class BlockGroup:
    index: int
    block: Block
    plan: BlockPlan
    layout: ChunkLayout
    params: list[nn.Parameter]                 # the slot-backed parameters the module now uses
    master: Chunk | None                       # None in inference-only runs (train=False), as the moments
    exp_avg: Chunk | None
    exp_avg_sq: Chunk | None
    param_home: Chunk | None                   # streamed (or sharded) blocks only
    slot: Slot
    steps: list[torch.Tensor]                  # AdamW step count per parameter (the fused kernel's form)
    group_of: list[int]                        # the optimizer's param group of each parameter
    compute: torch.dtype                       # dtype of the slot and the param home
    mem: MemorySystem
    comm: Collectives
    shard: tuple[int, int] | None = None       # data parallel, sharded: the elements [start, end) this rank holds
    mean_over: int = 0                         # ranks whose gradients the reduced sum averages (0: comm's world)
    reduces_at_end: bool = False               # reduced when backward ends, never before (expert replicas: a
    #                                            rank's held experts may get no gradient where a replica's do)
    experts: "BlockGroup | None" = None        # expert parallel: the group of this block's held experts
    grad_floors: tuple[int, int, int] = (0, 0, 0)  # bounded gradients (the runtime's): bytes a grad chunk takes at
    #                                            least, this rank's part and a whole block's sum, and the size kept
    #                                            at the pool's far end
    grads: GradBuffer = field(init=False)
    grad_count: int = 0                        # parameters whose gradient arrived in the current backward
    pending: Future | None = None              # its update in flight
    reducing: "Reduction | None" = None        # data parallel: its gradients' reduction in flight
    version: int = 0                           # the params include the updates of steps < version
    local: Chunk | None = None                 # data parallel: this rank's gradients, summed over micro-batches
    slot_stale: bool = False                   # a resident sharded block's slot awaits the gather of its update
    gathering: "Waitable | None" = None        # that gather, started ahead of the block's forward
    acquire: Callable[["BlockGroup"], None] | None = None      # the device cache's: a slot, filled (streamed)
    ready: Callable[["BlockGroup"], None] | None = None        # the update mode's: params final enough to use
    params_written: Callable[["BlockGroup"], None] | None = None  # the cache's: a slot's copy went stale

    def __post_init__(self) -> None:
        self.grads = GradBuffer(len(self.params))
        self.mean_over = self.mean_over or self.comm.world_size
        self.local_has = [False] * len(self.params)
        self.view_params, self._cuts = _state_cuts(self.layout, self.shard)

    # -- the verbs -----------------------------------------------------------------------
    def fetch(self) -> None:
        """The block's compute params on the device and usable: a streamed block takes a slot (the
        cache copies or gathers it in, or finds it there); a resident one waits for its update if the
        mode says so, and a sharded one gathers the update's shards into its slot."""
        if self.plan.stream:
            self.acquire(self)
            return
        self.ready(self)
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        elif self.slot_stale:
            self.gather_into(self.slot.chunk)
        self.slot_stale = False

    def gather_ahead(self) -> None:
        """A resident sharded block whose slot is stale: start gathering its updated shards now, once
        its update is final (every rank waits for the same update, so every rank issues the same
        gathers in the same order), so the gather runs while the block before it computes."""
        if self.plan.stream or not self.slot_stale or self.gathering is not None:
            return
        self.ready(self)
        self.gathering = self.gather_into(self.slot.chunk, async_op=True)

    def gather_into(self, dst: Chunk, async_op: bool = False):
        """The block's compute params, whole, into ``dst`` (a device slot): every rank's shard of them."""
        dtype = F32 if self.param_home is self.master else self.compute
        out = dst.typed(self.compute)[: self.layout.numel]
        if self.param_home.tier is Tier.DISK:  # an fp32 master on disk: this rank's shard read into its place
            n = self.layout.shard_numel
            src = out[self.shard[0] : self.shard[0] + n]
            self.mem.read_into(self.param_home, src.view(torch.uint8))
        else:
            src = self.param_home.typed(dtype)[: self.layout.shard_numel]
        return self.comm.all_gather(out, src, async_op=async_op)

    def release(self) -> None:
        """Drop the gradients gathered for a step that will not update (zero_grad, a skipped fp16 step,
        a backward that raised: a reduction it left in flight is waited for first, since it still
        writes into ``local`` and its fresh chunk)."""
        self.abandon_reduce()
        for chunk in (self.grads.clear(), self.local):
            if chunk is not None:
                self.mem.release(chunk)
        self.local, self.local_has = None, [False] * len(self.params)

    def reduce_grads(self, step: int, hypers: list[AdamWHyper] | None, make_room: Callable[[Tier], None],
                     final: bool) -> None:
        """Move the parameters' fresh gradients into the block's grad chunk (accumulating) and free
        them. With data parallel they first sum over the micro-batches in ``local``, and on the
        ``final`` one are averaged over the ranks (reduce-scattered to the shards, or all-reduced)
        before they join the grad chunk. The chunk lives where the block's update runs
        (``plan.bytes.grad_tier``). ``make_room(tier)`` returns once a new chunk may be allocated
        there (transient gradients); ``hypers``: lockfree keeps the step's own with its gradients."""
        if self.mean_over > 1:
            if self.local is None and updated_away(self.plan):
                make_room(grad_tier(self.plan))  # transient gradients: ``local`` is one more whole-block chunk
            self._sum_locally()
            if final:
                self._reduce_over_ranks(step, hypers, make_room)
            self.grad_count = 0
            return
        fresh = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        for p in self.params:
            p.grad = None
        self.add_grads(fresh, step, hypers, make_room)
        self.grad_count = 0

    def add_grads(self, grads: list[tuple[int, torch.Tensor]], step: int, hypers: list[AdamWHyper] | None,
                  make_room: Callable[[Tier], None]) -> None:
        """One process: (parameter index, gradient) pairs into the grad chunk, a new one if the update
        took the last (``make_room`` first, as in ``reduce_grads``)."""
        fresh = None
        while True:  # a lockfree update loop may take the chunk at any moment between these lines
            with self.grads.lock:
                if self.grads.chunk is None and fresh is not None:
                    self.grads.chunk, fresh = fresh, None
                if self.grads.chunk is not None:
                    self.grads.add(grads, self.views(self.grads.chunk), step, hypers)
                    break
            if updated_away(self.plan):
                make_room(grad_tier(self.plan))  # outside the lock: it may wait for this block's own update
            fresh = self._new_grad_chunk(self.nbytes)
        if fresh is not None:
            self.mem.release(fresh)

    def update(self, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
        """Apply the gathered gradients to master and moments (which must be in memory), free the
        gradients, publish the new compute params, and note the step they now include."""
        taken = self.grads.take()
        if taken is not None:
            adamw_block(self, taken.hypers or hypers, coef, taken)
            self.mem.release(taken.chunk)  # gradients live from backward's flush to here
        self.publish()
        if taken is not None:
            self.version = max(self.version, taken.step + 1)

    def publish(self) -> None:
        """Write the fp32 master into the compute copy the next forward reads (rounded to the compute
        dtype), and let the cache (or, for a resident sharded block, its next fetch) know a slot's copy
        of it is stale."""
        target = self.param_home if self.param_home is not None else self.slot.chunk
        if target is not self.master:  # an fp32 master doubles as the param home of a streamed block
            n = self.state_numel
            target.typed(self.compute)[:n].copy_(self.master.typed(F32)[:n])
        if self.shard is not None and not self.plan.stream:
            self.slot_stale = True
        self.params_written(self)

    # -- data parallel -------------------------------------------------------------------
    def _sum_locally(self) -> None:
        """This rank's fresh gradients into ``local`` (its own sum over micro-batches), freed from the params."""
        if self.local is None:
            self.local = self._new_grad_chunk(self.nbytes)
            self.local.typed(F32).zero_()  # a parameter no rank's micro-batch reached contributes zeros
        views = self.views(self.local)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.local_has[i]:
                views[i].add_(p.grad.to(views[i].device))  # a GPU's gradient into a host chunk: copied first
            else:
                views[i].copy_(p.grad)
                self.local_has[i] = True
            p.grad = None

    def _reduce_over_ranks(self, step: int, hypers: list[AdamWHyper] | None, make_room: Callable[[Tier], None]) -> None:
        """Start averaging ``local`` over the ranks into this rank's part (its shard, or all of it),
        reduced straight into a fresh grad chunk (no temporary); ``finish_reduce`` adds it to the grad
        chunk once it has landed. Started, not waited for: the runtime lets it run under the next
        block's backward. A parameter has a gradient where any rank's micro-batches gave it one."""
        if updated_away(self.plan):
            make_room(grad_tier(self.plan))
        fresh = self._new_grad_chunk(self.state_numel * F32.itemsize)  # before any collective: if this
        mine = fresh.typed(F32)[: self.state_numel]                    # raises, no rank has issued one
        has = torch.tensor(self.local_has, dtype=torch.uint8)
        works = [self.comm.all_reduce(has, op="max", async_op=True)]
        full = self.local.typed(F32)[: self.layout.numel]
        if self.shard is None:
            works.append(self.comm.all_reduce(full, async_op=True))
            works.append(Copy(mine, full))
        else:
            works.append(self.comm.reduce_scatter(mine, full, async_op=True))
        self.reducing = Reduction(works, fresh, mine, has, step, hypers)

    def abandon_reduce(self) -> None:
        """A reduction left in flight by a backward that raised: let it land (or fail: a lost rank is
        reported where the step raised) and free its chunk; its gradients are dropped."""
        r, self.reducing = self.reducing, None
        if r is None:
            return
        try:
            for w in r.works:
                w.wait()
        except Exception:  # noqa: BLE001 - the error that matters was raised where backward stopped
            pass
        self.mem.release(r.fresh)

    def finish_reduce(self) -> None:
        """Wait for the reduction ``_reduce_over_ranks`` started and add this rank's part, averaged, to
        the grad chunk; the block's gradients are then final. Nothing to do if none is in flight."""
        r, self.reducing = self.reducing, None
        if r is None:
            return
        for w in r.works:
            w.wait()
        r.mine.div_(self.mean_over)
        fresh = r.fresh
        with self.grads.lock:
            if self.grads.chunk is None:
                self.grads.chunk, fresh = fresh, None
            else:
                self.grads.chunk.typed(F32)[: self.state_numel].add_(r.mine)
            self.grads.has_grad = [a or bool(b) for a, b in zip(self.grads.has_grad, r.has.tolist())]
            self.grads.step, self.grads.hypers = r.step, r.hypers
        for chunk in (fresh, self.local):
            if chunk is not None:
                self.mem.release(chunk)
        self.local, self.local_has = None, [False] * len(self.params)
        if self.nbytes >= TRIM_AFTER:
            release_free_heap()  # the transport's buffers for a large chunk, freed, would stay in its threads' heaps

    def _new_grad_chunk(self, nbytes: int) -> Chunk:
        mine, whole, top = self.grad_floors  # bounded gradients: sizes that never fragment (``Runtime._grad_floors``)
        at_top = nbytes == top
        if not at_top:
            nbytes = max(nbytes, whole if nbytes > self.state_numel * F32.itemsize else mine)
        return self.mem.allocate(f"{self.block.name}.grad", nbytes, grad_tier(self.plan), Kind.GRAD, contiguous=True,
                                 top=at_top)

    # -- views -------------------------------------------------------------------------
    @property
    def states(self) -> tuple[Chunk, Chunk, Chunk]:
        return self.master, self.exp_avg, self.exp_avg_sq

    @property
    def state_numel(self) -> int:
        """Elements of this rank's states (its shard, or the whole block)."""
        return self.layout.numel if self.shard is None else self.shard[1] - self.shard[0]

    @property
    def on_disk(self) -> list[Chunk]:
        """The states that live on disk between steps (``plan.bytes.state_homes``), which cross to the
        host for each update and back; a ``host_master`` block's master stays where it is."""
        return [c for c, home in zip(self.states, state_homes(self.plan)) if home is Tier.DISK]

    @property
    def fills_slot_from_disk(self) -> bool:
        """A streamed fp32 block without a param home of its own whose master travels between disk and
        host: its slot is copied from that master, so the master must stay put (its write-back landed,
        no read in) while the slot is filled."""
        return self.param_home is not None and self.param_home is self.master and master_home(self.plan) is Tier.DISK

    @property
    def nbytes(self) -> int:
        return self.layout.numel * F32.itemsize

    def views(self, chunk: Chunk) -> list[torch.Tensor]:
        """Per-parameter fp32 views of a whole-block chunk (merged) in layout order."""
        flat = chunk.typed(F32)
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    @property
    def state_cuts(self) -> list[tuple[int, int]]:
        """[lo, hi) within a state chunk of each piece of a parameter this rank holds (``view_params``)."""
        return self._cuts

    def state_views(self, chunk: Chunk) -> list[torch.Tensor]:
        """fp32 views of a state chunk, one per piece of a parameter this rank holds (``view_params``
        names the parameter of each): per parameter, or its sharded pieces."""
        flat = chunk.typed(F32)
        return [flat[lo:hi] for lo, hi in self._cuts]


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
    if group.shard is None:
        views = group.views
    else:
        views = group.state_views
    masters = views(group.master)
    if masters:  # a shard may hold no piece of this block
        steps_beside(group, masters[0].device)
    adamw_step(masters, views(taken.chunk), views(group.exp_avg), views(group.exp_avg_sq),
               [group.steps[i] for i in owners], [taken.has_grad[i] for i in owners],
               [group.group_of[i] for i in owners], hypers, coef)


def steps_beside(group: BlockGroup, device: torch.device) -> None:
    """Fused AdamW wants each step count on its parameter's device (torch's CUDA kernel refuses CPU
    counts): a block whose master is homed on the GPU keeps its counts there, moved at its first update."""
    if group.steps and group.steps[0].device != device:
        group.steps[:] = [s.to(device) for s in group.steps]
