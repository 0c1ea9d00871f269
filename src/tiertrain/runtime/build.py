"""Building a model's block groups: device slots, the chunks of each block written from its
weights (or left for a checkpoint to fill), and the module's parameters re-pointed at the slots.

The fp32 master is written first and the compute copies (slot, param home) from it, so every
copy is the master rounded to the compute dtype, as the optimizer will publish it. Every group is
made by ``BlockGroup``'s one constructor (a replan makes its groups the same way from the chunks it moved).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from tiertrain.memory import ChunkLayout, Kind, MemorySystem, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.models.init import init_in_place
from tiertrain.parallel import Collectives
from tiertrain.parallel.experts import ExpertParallel
from tiertrain.plan import BlockPlan, Plan, RunOptions
from tiertrain.plan.bytes import (experts_plan, grad_tier, in_pieces, master_home, master_in_slot, separate_param_home,
                                  sharded, state_homes, updated_away)
from tiertrain.plan.fit import grad_floors
from tiertrain.precisions import torch_dtype
from tiertrain.runtime.block_group import F32, BlockGroup, GroupChunks, GroupLayout
from tiertrain.runtime.blocks import Block, HeldExperts, block_layout, split_experts
from tiertrain.runtime.context import RunContext
from tiertrain.runtime.slots import DeviceSlot, alias

LetGo = Callable[[nn.Parameter, nn.Parameter], None]  # (the model's original, the parameter now in its place)


@dataclass(frozen=True)
class BuildSpec:
    """What every group of a run is built with besides its block."""

    plan: Plan
    options: RunOptions
    group_of_param: dict[int, int]        # the optimizer's param group of each of the model's parameters, by id
    bounded: bool                         # backward waits for updates to free gradient chunks (bounded gradients)
    reduced_at_end: frozenset[int]        # blocks whose gradients are reduced only when backward ends
    let_go: LetGo | None = None


def layouts_for(blocks: list[Block], plan: Plan) -> list[ChunkLayout]:
    """Each block's chunk layout: padded to split over the data-parallel ranks where it is sharded."""
    return [block_layout(b, plan.parallel.shard_ranks if sharded(bp, plan) else 1)
            for b, bp in zip(blocks, (*plan.blocks, plan.rest))]


def ring_slots(mem: MemorySystem, layouts: list[ChunkLayout], plan: Plan) -> list[DeviceSlot]:
    """The slots streamed blocks share: the window plus the cache, each as large as the largest."""
    streamed = [lay for lay, p in zip(layouts, (*plan.blocks, plan.rest)) if p.stream]
    if not streamed:
        return []
    size = max(lay.numel for lay in streamed) * torch_dtype(plan.compute_dtype).itemsize
    return [DeviceSlot(mem.allocate(f"slot.{k}", size, Tier.DEVICE, Kind.PARAM, contiguous=True))
            for k in range(min(plan.window + plan.cache, len(streamed)))]


def build_groups(ctx: RunContext, model: nn.Module, blocks: list[Block], spec: BuildSpec,
                 replaced: dict[int, nn.Parameter], experts: ExpertParallel | None = None) -> list[BlockGroup]:
    """One group per block, each with its chunks written and its parameters installed in the model
    (and in ``blocks``, in place). ``replaced`` receives the slot-backed parameter that stands for each
    of the model's, by the original's id: an original may be freed once ``let_go(original, new)`` has
    been called for it (setup swaps it in the user's optimizer there, so the originals go block by
    block, not all at the end), so ``replaced`` serves only while the runtime is made: its ids stay
    unique there because what it is compared with (the other ranks' experts, held by the unsplit
    blocks) outlives the build; a mixture-of-experts block's originals go only when the build ends. With
    data parallel, rank 0's initial weights are every rank's (as DDP broadcasts them). With expert
    parallel (``experts``) a block's held experts form a group of their own, right after the block's."""
    plan = spec.plan
    held: dict[int, HeldExperts] = {}
    if experts is not None:
        blocks, held = split_experts(blocks, lambda m: experts.owned(m.n_experts))
    layouts = layouts_for(blocks, plan)
    bplans = (*plan.blocks, plan.rest)
    laid_out = [(lay, bp, sharded(bp, plan)) for lay, bp in zip(layouts, bplans)]
    laid_out += [(block_layout(h.block), bplans[i], False) for i, h in held.items()]  # held experts: never sharded
    floors = grad_floors_for(laid_out, ctx.comm.world_size) if spec.bounded else {}
    ring = ring_slots(ctx.mem, layouts, plan)
    compute = torch_dtype(plan.compute_dtype)
    groups: list[BlockGroup] = []
    streamed_seen = 0
    for i, (block, bplan, layout) in enumerate(zip(blocks, bplans, layouts)):
        if bplan.stream:
            slot = ring[streamed_seen % len(ring)]
            streamed_seen += 1
        else:
            nbytes = layout.numel * compute.itemsize
            slot = DeviceSlot(ctx.mem.allocate(f"{block.name}.slot", nbytes, Tier.DEVICE, Kind.PARAM, contiguous=True))
        index = len(groups)
        build, comm = (_build_sharded, ctx.shards or ctx.comm) if sharded(bplan, plan) else (_build, ctx.comm)
        chunks, shard = build(ctx.mem, comm, index, block, bplan, slot, plan, spec.options, compute, layout)
        held_group = None
        if i in held:  # its experts' group next, so that the block's group is made with it
            held_group = _build_experts(ctx, model, experts, index + 1, held[i], bplan, spec, compute, replaced, floors)
        laid = GroupLayout(shard, ctx.comm.world_size, block.name in spec.reduced_at_end, floors_of(floors, bplan),
                           Tier(spec.plan.reduce_on), torch_dtype(spec.plan.reduce_dtype),
                       spec.plan.reduce_every == "step")
        groups.append(_made(ctx, model, index, block, bplan, layout, chunks, compute, spec, replaced, laid,
                            held_group, comm))
        if held_group is not None:
            groups.append(held_group)
    return groups


def grad_floors_for(chunks: list[tuple[ChunkLayout, BlockPlan, bool]], world: int) -> dict[Tier, tuple[int, int]]:
    """With gradients bounded, per tier: ``plan.bytes.grad_floors`` of the chunks updates take away there,
    from each group's (layout, plan, sharded): this rank's part of each."""
    away: dict[Tier, list[int]] = {}
    for lay, bp, split in chunks:
        if updated_away(bp):
            away.setdefault(grad_tier(bp), []).append((lay.shard_numel if split else lay.numel) * F32.itemsize)
    return {tier: grad_floors(own, world) for tier, own in away.items()}


def floors_of(floors: dict[Tier, tuple[int, int]], bplan: BlockPlan) -> tuple[int, int]:
    """A block's bounded grad chunk sizes: those of its gradients' tier, where its updates take them away."""
    return floors.get(grad_tier(bplan), (0, 0)) if updated_away(bplan) else (0, 0)


def _made(ctx: RunContext, model: nn.Module, index: int, block: Block, bplan: BlockPlan, layout: ChunkLayout,
          chunks: GroupChunks, compute: torch.dtype, spec: BuildSpec, replaced: dict[int, nn.Parameter],
          laid: GroupLayout, experts: BlockGroup | None = None, comm: Collectives | None = None) -> BlockGroup:
    """The group, with its parameters in the model and in ``block`` in place of the originals, which are
    let go of: their values are in the chunks now, and a run larger than memory must not keep its whole
    initial model alive beside its budgets (nor, in setup, beside the pools it fills)."""
    params = [nn.Parameter(t, requires_grad=spec.options.train) for t in alias(chunks.slot, layout, compute)]
    steps = [torch.zeros((), dtype=F32) for _ in params]
    group_of = [spec.group_of_param.get(id(p), 0) for _, p in block.params]
    group = BlockGroup(index, block, bplan, layout, params, chunks, steps, group_of, compute, ctx, laid, experts, comm)
    install_params(model, block, params)
    pairs = [(old, new) for (_, old), new in zip(block.params, params)]
    replaced.update({id(old): new for old, new in pairs})
    block.params[:] = [(n, new) for (n, _), new in zip(block.params, params)]
    for old, new in pairs if spec.let_go is not None else ():
        spec.let_go(old, new)
    return group


def _build_experts(ctx: RunContext, model: nn.Module, experts: ExpertParallel, index: int, held: HeldExperts,
                   parent: BlockPlan, spec: BuildSpec, compute: torch.dtype, replaced: dict[int, nn.Parameter],
                   floors: dict[Tier, tuple[int, int]]) -> BlockGroup:
    """A block's held experts: their states at the block's home, their compute params in a device slot
    of their own (they do not stream: the window holds blocks), replicated over their replicas, and
    averaged over every rank (their gradients hold every rank's tokens). Rank 0's initial weights are
    every rank's, for the experts as for the rest."""
    bplan = experts_plan(parent)
    layout = block_layout(held.block)
    slot = DeviceSlot(ctx.mem.allocate(f"{held.block.name}.slot", layout.numel * compute.itemsize, Tier.DEVICE,
                                       Kind.PARAM, contiguous=True))
    values = _rank0_values(ctx.comm, held) if spec.options.init_states else held.block
    chunks, _ = _build(ctx.mem, experts.replicas, index, values, bplan, slot, spec.plan, spec.options, compute, layout)
    laid = GroupLayout(None, experts.dp, experts.replicas.world_size > 1, floors_of(floors, bplan),
                       Tier(spec.plan.reduce_on), torch_dtype(spec.plan.reduce_dtype),
                       spec.plan.reduce_every == "step")
    return _made(ctx, model, index, held.block, bplan, layout, chunks, compute, spec, replaced, laid,
                 comm=experts.replicas)


def _rank0_values(world: Collectives, held: HeldExperts) -> Block:
    """The held experts with rank 0's values: every expert of the block broadcast from rank 0 (as the
    block's other weights are), this rank's kept. A model on the meta device draws its held experts
    where they live instead (their replicas then take one replica's)."""
    if any(p.is_meta for _, p in held.every):
        return held.block
    flat = torch.cat([p.detach().reshape(-1) for _, p in held.every]).cpu()
    world.host.broadcast(flat)  # the model's own tensors: host memory
    value = dict(zip((n for n, _ in held.every), flat.split([p.numel() for _, p in held.every])))
    return Block(held.block.name, None, [(n, value[n].view(p.shape)) for n, p in held.block.params])


def _build(mem: MemorySystem, comm: Collectives, index: int, block: Block, bplan: BlockPlan, slot: DeviceSlot,
           plan: Plan, options: RunOptions, compute: torch.dtype,
           layout: ChunkLayout) -> tuple[GroupChunks, tuple[int, int] | None]:
    """Allocate the block's chunks, write its weights in, and leave its slot filled.
    ``separate_param_home`` (the planner's and the budget check's rule too): a streamed block keeps its
    compute params in a host chunk of their own, which the optimizer publishes into; else its fp32
    master is what its slot is filled from. ``master_in_slot``: the slot is the fp32 master itself."""
    master = exp_avg = exp_avg_sq = None
    if options.train:
        master, exp_avg, exp_avg_sq = _states(mem, comm, block, bplan, slot, plan, options, compute, layout)
    else:
        _fill(slot.chunk, block.params, layout, compute)
    slot.holder = index
    param_home = None
    if bplan.stream and not separate_param_home(bplan, plan, options.train):
        param_home = master  # fp32 compute: the slot is filled from the master, wherever it lives
    elif bplan.stream:
        param_home = mem.allocate(f"{block.name}.param", layout.numel * compute.itemsize, Tier.HOST, Kind.PARAM,
                                  contiguous=True)
        param_home.typed(compute)[: layout.numel].copy_(slot.chunk.typed(compute)[: layout.numel])
    for chunk, home in zip((master, exp_avg, exp_avg_sq), state_homes(bplan)):
        if chunk is not None and chunk.tier is not home:
            mem.move(chunk, home, contiguous=True).wait()
    return GroupChunks(master, exp_avg, exp_avg_sq, param_home, slot), None


def _states(mem: MemorySystem, comm: Collectives, block: Block, bplan: BlockPlan, slot: DeviceSlot, plan: Plan,
            options: RunOptions, compute: torch.dtype, layout: ChunkLayout) -> tuple[Chunk, Chunk, Chunk]:
    """The block's master and moments at their home, and its slot filled from the master (zeroed where
    the master is left unwritten for a checkpoint to fill). A block updated in pieces writes its
    weights to disk a parameter at a time: no host staging of a whole block."""
    if options.init_states and in_pieces(bplan):
        return _disk_chunks(mem, comm, block, layout, slot.chunk, compute, master_home(bplan))
    chunks = _optimizer_chunks if options.init_states else _unwritten_chunks
    in_slot = slot.chunk if master_in_slot(bplan, plan, options.train) else None
    master, exp_avg, exp_avg_sq = chunks(mem, block, layout, state_homes(bplan), in_slot)
    if options.init_states and comm.world_size > 1:  # rank 0's weights, over the group of the master's side
        (comm if master.tier is Tier.DEVICE else comm.host).broadcast(master.typed(F32))
    if master is not slot.chunk and master.tier is Tier.DISK:  # unwritten: nothing to publish yet
        slot.chunk.typed(compute).zero_()
    elif master is not slot.chunk:
        slot.chunk.typed(compute)[: layout.numel].copy_(master.typed(F32)[: layout.numel])
    return master, exp_avg, exp_avg_sq


def _build_sharded(mem: MemorySystem, comm: Collectives, index: int, block: Block, bplan: BlockPlan, slot: DeviceSlot,
                   plan: Plan, options: RunOptions, compute: torch.dtype,
                   layout: ChunkLayout) -> tuple[GroupChunks, tuple[int, int] | None]:
    """A sharded block: this rank's shard of master and moments at their home (none in a forward-only run),
    its shard of the compute params in the param home, the whole compute params in the slot. The block's
    weights are made whole once, on the host (one block at a time), as rank 0 has them."""
    lo, hi = layout.shard_range(comm.rank)
    nbytes = (hi - lo) * F32.itemsize
    # the whole block's weights, made once: in its fp32 slot where it has one (no temporary, which glibc
    # kept, block after block, growing the heap by a block each: 1.9 GB for a 482M model's setup)
    fp32_slot = compute == F32
    full = slot.chunk.typed(F32)[: layout.numel] if fp32_slot else torch.zeros(layout.numel, dtype=F32)
    full.zero_()
    if options.init_states:
        _fill_tensor(full, block.params, layout)
        (comm if fp32_slot else comm.host).broadcast(full)  # the device slot, or host memory of its own
    states = _shard_states(mem, block, bplan, nbytes, full[lo:hi]) if options.train else [None, None, None]
    if not fp32_slot:
        slot.chunk.typed(compute)[: layout.numel].copy_(full)
    slot.holder = index
    if separate_param_home(bplan, plan, options.train):
        param_home = mem.allocate(f"{block.name}.param", (hi - lo) * compute.itemsize, Tier.HOST, Kind.PARAM,
                                  contiguous=True)
        param_home.typed(compute).copy_(full[lo:hi])
    else:
        param_home = states[0]
    for chunk, home in zip(states, state_homes(bplan)):
        if chunk is not None and chunk.tier is not home:
            mem.move(chunk, home, contiguous=True).wait()
    return GroupChunks(*states, param_home, slot), (lo, hi)


def _shard_states(mem: MemorySystem, block: Block, bplan: BlockPlan, nbytes: int, mine: torch.Tensor) -> list[Chunk]:
    """This rank's shard of the block's master (``mine``) and zeroed moments, each at its home or, bound for
    disk, on the host for the caller to send there; a block updated in pieces writes its shard to disk
    where it lies (never staged whole on the host). A forward-only run has none."""
    pieced = in_pieces(bplan)
    states = [mem.allocate(f"{block.name}.{k.value}", nbytes, Tier.HOST if home is Tier.DISK and not pieced else home,
                           k, contiguous=True)
              for k, home in zip((Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ), state_homes(bplan))]
    mem.overwrite(states[0], mine.contiguous())
    for m in states[1:]:
        mem.zero(m)
    return states


def _fill(chunk: Chunk, params: list[tuple[str, torch.Tensor]], layout: ChunkLayout, dtype: torch.dtype) -> None:
    """Write the parameters' values into a chunk in layout order (initialising meta ones there)."""
    _fill_tensor(chunk.typed(dtype), params, layout)


def _fill_tensor(flat: torch.Tensor, params: list[tuple[str, torch.Tensor]], layout: ChunkLayout) -> None:
    flat.zero_()
    for s, (name, p) in zip(layout.slots, params):
        view = flat[s.offset : s.offset + s.numel]
        if p.is_meta:
            init_in_place(name, view.view(s.shape))
        else:
            view.copy_(p.detach().reshape(-1))


def _disk_chunks(mem: MemorySystem, comm: Collectives, block: Block, layout: ChunkLayout, slot: Chunk,
                 compute: torch.dtype, master_tier: Tier) -> tuple[Chunk, Chunk, Chunk]:
    """Master and moments of a block updated in pieces, written straight to disk: the master a
    parameter at a time (each drawn, or broadcast from rank 0, on its own, and its compute copy put
    in the slot), the moments as zeros, so the host never holds the block's states (``runtime.pieces``:
    which is why the block is updated in pieces). A ``host_master`` block's master goes into its
    host chunk the same way."""
    nbytes = layout.numel * F32.itemsize
    chunks = [mem.allocate(f"{block.name}.{k.value}", nbytes, home, k, contiguous=True)
              for k, home in ((Kind.MASTER, master_tier), (Kind.EXP_AVG, Tier.DISK), (Kind.EXP_AVG_SQ, Tier.DISK))]
    flat = slot.typed(compute)
    flat.zero_()

    def weights() -> Iterator[tuple[int, torch.Tensor]]:
        for s, (name, p) in zip(layout.slots, block.params):
            value = torch.empty(s.numel, dtype=F32)
            if p.is_meta:
                init_in_place(name, value.view(s.shape))
            else:
                value.copy_(p.detach().reshape(-1))
            if comm.world_size > 1:
                comm.host.broadcast(value)
            flat[s.offset : s.offset + s.numel].copy_(value)
            yield s.offset * F32.itemsize, value
    mem.write_parts(chunks[0], weights())
    for m in chunks[1:]:
        mem.zero(m)
    return chunks[0], chunks[1], chunks[2]


def _unwritten_chunks(mem: MemorySystem, block: Block, layout: ChunkLayout, homes: tuple[Tier, Tier, Tier],
                      slot: Chunk | None) -> tuple[Chunk, Chunk, Chunk]:
    """Master and moments at their homes, for a checkpoint to fill next (resume): no weights are
    drawn and nothing is staged on the host or written twice. Disk pages stay unwritten, so reading
    one before the checkpoint has written it fails; host and device bytes are zeroed."""
    nbytes = layout.numel * F32.itemsize
    kinds = list(zip((Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ), homes))
    out = [slot] if slot is not None else []
    out += [mem.allocate(f"{block.name}.{k.value}", nbytes, home, k, contiguous=True)
            for k, home in (kinds if slot is None else kinds[1:])]
    for chunk in out:
        if chunk.tier is not Tier.DISK:
            chunk.typed(F32).zero_()
    return out[0], out[1], out[2]


def _optimizer_chunks(mem: MemorySystem, block: Block, layout: ChunkLayout, homes: tuple[Tier, Tier, Tier],
                      slot: Chunk | None) -> tuple[Chunk, Chunk, Chunk]:
    """fp32 master (the weights) and zeroed moments, written where they live: at their homes, or
    on the host for the caller to send to disk (a disk chunk is written by moving it there).
    The budget check counts no host bytes for device-homed states, so they never pass through it.
    ``slot``: the master is that device slot itself (``plan.bytes.master_in_slot``)."""
    nbytes = layout.numel * F32.itemsize
    tier = [Tier.HOST if home is Tier.DISK else home for home in homes]
    master = slot or mem.allocate(f"{block.name}.master", nbytes, tier[0], Kind.MASTER, contiguous=True)
    _fill(master, block.params, layout, F32)
    moments = [mem.allocate(f"{block.name}.{k.value}", nbytes, t, k, contiguous=True)
               for k, t in zip((Kind.EXP_AVG, Kind.EXP_AVG_SQ), tier[1:])]
    for m in moments:
        m.typed(F32).zero_()
    return master, moments[0], moments[1]


def install_params(model: nn.Module, block: Block, params: list[nn.Parameter]) -> None:
    """Register the slot-backed parameters wherever the originals were registered (tied weights too)."""
    replace = {id(old): new for (_, old), new in zip(block.params, params)}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in replace:
                module._parameters[name] = replace[id(p)]
