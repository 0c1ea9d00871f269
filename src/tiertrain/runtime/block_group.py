"""One block's chunks and gradient bookkeeping, behind the verbs a step uses (the counterpart of
FSDP2's ``FSDPParamGroup``): ``fetch`` its compute params onto the device, ``release`` what it
holds for the step, ``reduce_grads`` as backward finishes it, ``update`` its states.

Chunks per block (one layout, in parameter order):
  ``master``, ``exp_avg``, ``exp_avg_sq``  fp32 optimizer state at the block's home tier;
  ``param_home``  a streamed block's compute params between uses (on the host, or its fp32
                  master itself wherever that lives), fetched into a device slot before each use;
  ``grads``       the gradients gathered since the last update (``grads.GradBuffer``).
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
from tiertrain.optim import AdamWHyper, adamw_step
from tiertrain.parallel import Collectives
from tiertrain.plan import BlockPlan
from tiertrain.plan.bytes import grad_tier
from tiertrain.runtime.blocks import Block
from tiertrain.runtime.grads import GradBuffer, TakenGrads
from tiertrain.runtime.slots import Slot

F32 = torch.float32


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
    param_home: Chunk | None                   # streamed blocks only
    slot: Slot
    steps: list[torch.Tensor]                  # AdamW step count per parameter (the fused kernel's form)
    group_of: list[int]                        # the optimizer's param group of each parameter
    compute: torch.dtype                       # dtype of the slot and the param home
    mem: MemorySystem
    comm: Collectives
    grads: GradBuffer = field(init=False)
    grad_count: int = 0                        # parameters whose gradient arrived in the current backward
    pending: Future | None = None              # its update in flight
    version: int = 0                           # the params include the updates of steps < version
    acquire: Callable[["BlockGroup"], None] | None = None      # the device cache's: a slot, filled (streamed)
    ready: Callable[["BlockGroup"], None] | None = None        # the update mode's: params final enough to use
    params_written: Callable[["BlockGroup"], None] | None = None  # the cache's: a slot's copy went stale

    def __post_init__(self) -> None:
        self.grads = GradBuffer(len(self.params))

    # -- the verbs -----------------------------------------------------------------------
    def fetch(self) -> None:
        """The block's compute params on the device and usable: a streamed block takes a slot (the
        cache copies it in, or finds it there); a resident one waits for its update if the mode says so."""
        if self.plan.stream:
            self.acquire(self)
        else:
            self.ready(self)

    def release(self) -> None:
        """Drop the gradients gathered for a step that will not update (zero_grad, a skipped fp16 step)."""
        chunk = self.grads.clear()
        if chunk is not None:
            self.mem.release(chunk)

    def reduce_grads(self, step: int, hypers: list[AdamWHyper] | None, make_room: Callable[[], None],
                     final: bool) -> None:
        """Move the parameters' fresh gradients into the block's grad chunk (accumulating) and free
        them; on the ``final`` micro-batch of a step the chunk is reduced across ranks (the identity
        in a world of one). The chunk lives where the block's update runs (``plan.bytes.grad_tier``).
        ``make_room`` returns once a new host chunk may be allocated (transient gradients);
        ``hypers``: lockfree keeps the step's own with its gradients."""
        fresh = None
        while True:  # a lockfree update loop may take the chunk at any moment between these lines
            with self.grads.lock:
                if self.grads.chunk is None and fresh is not None:
                    self.grads.chunk, fresh = fresh, None
                if self.grads.chunk is not None:
                    self.grads.add(self.params, self.views(self.grads.chunk), step, hypers)
                    if final:
                        flat = self.grads.chunk.typed(F32)
                        self.comm.reduce_scatter(flat, flat)
                    break
            if grad_tier(self.plan) is Tier.HOST:
                make_room()  # outside the lock: it may wait for this block's own update
            fresh = self.mem.allocate(f"{self.block.name}.grad", self.nbytes, grad_tier(self.plan), Kind.GRAD,
                                      contiguous=True)
        if fresh is not None:
            self.mem.release(fresh)
        self.grad_count = 0

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
        dtype), and let the cache know a slot's copy of it is stale."""
        target = self.param_home if self.param_home is not None else self.slot.chunk
        if target is not self.master:  # an fp32 master doubles as the param home of a streamed block
            target.typed(self.compute)[: self.layout.numel].copy_(self.master.typed(F32)[: self.layout.numel])
        self.params_written(self)

    # -- views -------------------------------------------------------------------------
    @property
    def states(self) -> tuple[Chunk, Chunk, Chunk]:
        return self.master, self.exp_avg, self.exp_avg_sq

    @property
    def fills_slot_from_master(self) -> bool:
        """A streamed fp32 block without a param home of its own: its slot is copied from the fp32
        master wherever that lives, so the master must stay put (its write-back landed, no read)."""
        return self.param_home is not None and self.param_home is self.master

    @property
    def nbytes(self) -> int:
        return self.layout.numel * F32.itemsize

    def views(self, chunk: Chunk) -> list[torch.Tensor]:
        """Per-parameter fp32 views of a chunk (merged) in layout order."""
        flat = chunk.typed(F32)
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]


def adamw_block(group: BlockGroup, hypers: list[AdamWHyper], coef: torch.Tensor | None, taken: TakenGrads) -> None:
    """One AdamW step of the block's master and moments with the gradients it took."""
    adamw_step(group.views(group.master), group.views(taken.chunk), group.views(group.exp_avg),
               group.views(group.exp_avg_sq), group.steps, taken.has_grad, group.group_of, hypers, coef)
