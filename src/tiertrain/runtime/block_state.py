"""One block's runtime state: its chunks in the memory tiers and its slot-backed parameters.

Chunks per block (layout in parameter order, fp32 compute for now):
  ``param``     compute params between uses, on the host (streamed blocks only: they are
                fetched from here into a device slot before each use);
  ``master``, ``exp_avg``, ``exp_avg_sq``  fp32 optimizer state at the block's home tier;
  ``grad``      fp32 gradients accumulated as backward finishes the block, on the host (on
                the device for a device-homed block, whose update runs there).

The module's parameters are replaced once, at setup, by tensors that alias the block's
device slot (``Tensor.set_`` onto the pool's storage). Refilling a slot writes the pool
buffer, never these tensors, so no ``.data`` swap is needed and autograd's saved
parameters stay valid as long as the slot holds this block when its backward runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tiertrain.memory import ChunkLayout, Kind, MemorySystem, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.runtime.blocks import Block
from tiertrain.plan import BlockPlan

F32 = torch.float32


@dataclass
class TakenGrads:
    """A block's gathered gradients, as the optimizer takes them."""

    chunk: Chunk
    has_grad: list[bool]                       # per parameter: whether it got a gradient
    step: int                                  # the latest training step they include
    groups: list[dict] | None = None           # lockfree: that step's hyperparameters (None: the update's)


@dataclass
class Slot:
    """A region of the device pool that holds one block's compute params at a time."""

    chunk: Chunk
    holder: int | None = None  # index of the block whose params are in it


def slot_base(slot: Slot) -> tuple[torch.UntypedStorage, int]:
    """The device pool's storage and the slot's byte offset in it."""
    flat = slot.chunk.merge()
    return flat.untyped_storage(), flat.storage_offset()  # uint8 storage: offsets in bytes


def alias(slot: Slot, layout: ChunkLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of each parameter's shape living in the slot's memory, with their own version counters."""
    storage, base = slot_base(slot)
    out = []
    for s in layout.slots:
        t = torch.empty(0, dtype=dtype, device=storage.device)
        t.set_(storage, (base + s.offset * dtype.itemsize) // dtype.itemsize, s.shape)
        out.append(t)
    return out


def rebind(st: "BlockState", slot: Slot) -> None:
    """Point the block's parameters at another slot (the device cache moved it).

    ``set_`` counts as an in-place change, which would make autograd refuse the parameters it
    saved in forward; the values are the same block's, so the version counters are put back
    (torch's ``_unsafe_set_version_counter``, made for exactly this kind of storage swap).
    Saved *views* of the parameters are rebuilt from the new slot at unpack time instead."""
    storage, base = slot_base(slot)
    versions = tuple(p._version for p in st.params)
    with torch.no_grad():
        for p, s in zip(st.params, st.layout.slots):
            p.set_(storage, (base + s.offset * st.compute.itemsize) // st.compute.itemsize, s.shape)
    torch._C._autograd._unsafe_set_version_counter(tuple(st.params), versions)
    st.slot = slot


@dataclass
class BlockState:
    index: int
    block: Block
    plan: BlockPlan
    layout: ChunkLayout
    params: list[nn.Parameter]                 # the slot-backed parameters the module now uses
    master: Chunk | None                       # None in inference-only runs (train=False), as below
    exp_avg: Chunk | None
    exp_avg_sq: Chunk | None
    grad: Chunk | None                         # exists from the first flush until the block's update
    param_home: Chunk | None                   # streamed blocks only
    slot: Slot
    steps: list[torch.Tensor]                  # AdamW step count per parameter (fused kernel's form)
    group_of: list[int]                        # user's param group index per parameter
    has_grad: list[bool] = field(default_factory=list)
    grad_count: int = 0                        # grads accumulated in the current backward
    pending_update: object = None              # Handle-like of an update in flight
    lock: threading.Lock = field(default_factory=threading.Lock)  # grads: backward fills, the optimizer takes
    grad_step: int = -1                        # the latest step whose gradients are in ``grad``
    grad_groups: list[dict] | None = None      # lockfree: the hyperparameters of that step
    version: int = 0                           # params include the updates of steps < version
    running: bool = False                      # lockfree: an update loop is working on this block
    compute: torch.dtype = F32                 # dtype of the slot and param home
    stash: object = None                       # offload_hidden: the HostStash holding saved activations

    def take_grads(self) -> TakenGrads | None:
        """Hand the accumulated gradients to the optimizer; backward starts a fresh chunk."""
        with self.lock:
            taken = None if self.grad is None else TakenGrads(self.grad, self.has_grad, self.grad_step,
                                                              self.grad_groups)
            self.grad, self.has_grad = None, [False] * len(self.params)
            return taken

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


def init_in_place(name: str, out: torch.Tensor) -> None:
    """Initialise a parameter of a model built on the meta device (to be larger than memory),
    GPT-2 style, directly in its chunk (no temporary tensor): matrices N(0, 0.02), 1-D
    ``*.weight`` (norm scales) ones, everything else zeros."""
    if out.dim() >= 2:
        out.normal_(0.0, 0.02)
    else:
        out.fill_(1.0 if name.endswith("weight") else 0.0)


def _fill(chunk: Chunk, params: list[tuple[str, torch.Tensor]], layout: ChunkLayout, dtype: torch.dtype) -> None:
    """Write the parameters' values into a chunk in layout order (initialising meta ones there)."""
    flat = chunk.typed(dtype)
    flat.zero_()
    for s, (name, p) in zip(layout.slots, params):
        view = flat[s.offset : s.offset + s.numel]
        if p.is_meta:
            init_in_place(name, view.view(s.shape))
        else:
            view.copy_(p.detach().reshape(-1))


def publish(master: Chunk, dst: Chunk, layout: ChunkLayout, dtype: torch.dtype) -> None:
    """Write the fp32 master into a compute copy (rounded to ``dtype`` when that is not fp32)."""
    dst.typed(dtype)[: layout.numel].copy_(master.typed(F32)[: layout.numel])


def _unwritten_chunks(mem: MemorySystem, block: Block, layout: ChunkLayout, home: Tier,
                      slot: Chunk | None) -> tuple[Chunk, Chunk, Chunk]:
    """Master and moments at their home, for a checkpoint to fill next (resume): no weights are
    drawn and nothing is staged on the host or written twice. Disk pages stay unwritten, so reading
    one before the checkpoint has written it fails; host and device bytes are zeroed."""
    nbytes = layout.numel * F32.itemsize
    out = [slot] if slot is not None else []
    out += [mem.allocate(f"{block.name}.{k.value}", nbytes, home, k, contiguous=True)
            for k in ((Kind.MASTER,) if slot is None else ()) + (Kind.EXP_AVG, Kind.EXP_AVG_SQ)]
    for chunk in out:
        if chunk.tier is not Tier.DISK:
            chunk.typed(F32).zero_()
    return out[0], out[1], out[2]


def _optimizer_chunks(mem: MemorySystem, block: Block, layout: ChunkLayout, home: Tier,
                      slot: Chunk | None) -> tuple[Chunk, Chunk, Chunk]:
    """fp32 master (the weights) and zeroed moments, written where they live: at their home, or
    on the host for the caller to send to disk (a disk chunk is written by moving it there).
    The budget check counts no host bytes for device-homed states, so they never pass through it.
    ``slot``: the master is that device slot itself (``plan_bytes.master_in_slot``).
    (Gradient chunks are allocated when backward first flushes into them.)"""
    nbytes, tier = layout.numel * F32.itemsize, Tier.HOST if home is Tier.DISK else home
    master = slot or mem.allocate(f"{block.name}.master", nbytes, tier, Kind.MASTER, contiguous=True)
    _fill(master, block.params, layout, F32)
    moments = [mem.allocate(f"{block.name}.{k.value}", nbytes, tier, k, contiguous=True)
               for k in (Kind.EXP_AVG, Kind.EXP_AVG_SQ)]
    for m in moments:
        m.typed(F32).zero_()
    return master, moments[0], moments[1]


def build_state(mem: MemorySystem, index: int, block: Block, plan: BlockPlan, slot: Slot,
                group_of: list[int], train: bool = True, own_param_home: bool = False,
                compute: torch.dtype = F32, master_in_slot: bool = False, init: bool = True) -> BlockState:
    """Allocate the block's chunks, copy its current weights in, and leave its slot filled.

    The fp32 master is written first and the compute copies (slot, param home) from it.
    ``own_param_home`` (``plan_bytes.separate_param_home``, the planner's and the budget check's
    rule too): a streamed block keeps its compute params in a host chunk of their own, which the
    optimizer publishes into; else its fp32 master is what its slot is filled from.
    ``master_in_slot`` (``plan_bytes.master_in_slot``): the slot is the fp32 master itself.
    ``init=False``: a checkpoint fills the states next (``_unwritten_chunks``)."""
    layout = ChunkLayout.build([(n, tuple(p.shape)) for n, p in block.params])
    master = exp_avg = exp_avg_sq = None
    if train:
        chunks = _optimizer_chunks if init else _unwritten_chunks
        master, exp_avg, exp_avg_sq = chunks(mem, block, layout, plan.home, slot.chunk if master_in_slot else None)
        if master is not slot.chunk and master.tier is Tier.DISK:  # unwritten: nothing to publish yet
            slot.chunk.typed(compute).zero_()
        elif master is not slot.chunk:
            publish(master, slot.chunk, layout, compute)
    else:
        _fill(slot.chunk, block.params, layout, compute)
    slot.holder = index
    param_home = None
    if plan.stream and not own_param_home:
        param_home = master  # fp32 compute: the slot is filled from the master, wherever it lives
    elif plan.stream:
        param_home = mem.allocate(f"{block.name}.param", layout.numel * compute.itemsize, Tier.HOST, Kind.PARAM,
                                  contiguous=True)
        param_home.typed(compute)[: layout.numel].copy_(slot.chunk.typed(compute)[: layout.numel])
    for chunk in (master, exp_avg, exp_avg_sq):
        if chunk is not None and chunk.tier is not plan.home:
            mem.move(chunk, plan.home, contiguous=True).wait()
    params = [nn.Parameter(t, requires_grad=train) for t in alias(slot, layout, compute)]
    steps = [torch.zeros((), dtype=F32) for _ in params]
    return BlockState(index, block, plan, layout, params, master, exp_avg, exp_avg_sq, None, param_home,
                      slot, steps, group_of, has_grad=[False] * len(params), compute=compute)


def install_params(model: nn.Module, state: BlockState) -> None:
    """Register the slot-backed parameters wherever the originals were registered (tied weights too)."""
    replace = {id(old): new for (_, old), new in zip(state.block.params, state.params)}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in replace:
                module._parameters[name] = replace[id(p)]
