"""A new plan taking effect at a step boundary: every state moved to the tier the plan names, the
device slots and compute copies rebuilt, and the blocks' groups made anew (through the constructor
setup's build uses) over the same chunks and the same parameter objects, re-pointed at the new slots.

Used by ``plan="auto"`` without a profile function: the first step runs under a conservative plan
and is the profile; the chosen plan then takes over. Numerics do not change: masters and moments
move byte for byte and the compute copies are written from the masters, as an update writes them.
Between steps no gradient is alive and no update runs, so only states and compute copies move.
The order keeps every tier within what the two plans need: the compute copies are dropped first
(the masters hold the values), states going to disk move before those coming to the device, and
those to the host last; each plan fits its budgets alone (the budget check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiertrain.memory import Kind, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.plan import BlockPlan, Plan
from tiertrain.plan.bytes import experts_plan, master_in_slot, separate_param_home, state_homes
from tiertrain.plan.fit import check_device_room
from tiertrain.precisions import torch_dtype
from tiertrain.runtime.block_group import F32, BlockGroup, GroupChunks, GroupLayout
from tiertrain.runtime.build import floors_of, grad_floors_for, ring_slots
from tiertrain.runtime.slots import DeviceSlot

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime

_MOVE_ORDER = (Tier.DISK, Tier.DEVICE, Tier.HOST)


def replan(rt: "Runtime", plan: Plan) -> None:
    """Run ``rt`` under ``plan`` (resolved for the run: ``plan.fit.resolve``) from the next step on (call
    between steps; training runs only)."""
    if not rt.options.train:
        raise ValueError("replan moves optimizer states; a forward-only run has none to move")
    if plan.resolved is None:
        raise ValueError("internal: replan runs a resolved plan (tiertrain.plan.fit.resolve)")
    plan = plan.validate(len(_blocks(rt.groups)) - 1)
    pool = rt.mem.pool(Tier.DEVICE)
    check_device_room(rt.sizes, plan, pool.page_size, pool.capacity, plan.resolved.bounded)
    rt.wait_updates()
    rt.cache.settle()
    for g in rt.groups:
        g.release()
    _drop_compute_copies(rt)
    old = rt.groups
    plans = _new_plans(old, plan)
    for tier in _MOVE_ORDER:
        for g in old:
            for chunk, home in zip(g.states, state_homes(plans[g.index])):
                if home is tier and chunk.tier is not tier:
                    rt.mem.move(chunk, tier, contiguous=True).wait()
    copies = _compute_copies(rt, old, plans, plan)
    floors = grad_floors_for([(g.layout, plans[g.index], g.shard is not None) for g in old],
                             rt.comm.world_size) if plan.resolved.bounded else {}
    made: dict[int, BlockGroup] = {}
    for g in reversed(old):  # a block's held experts come after it: made first, so the block is made with them
        slot, param_home = copies[g.index]
        bp = plans[g.index]
        laid = GroupLayout(g.shard, g.mean_over, g.reduces_at_end, floors_of(floors, bp), Tier(plan.reduce_on),
                           torch_dtype(plan.reduce_dtype), plan.reduce_every == "step")
        made[g.index] = BlockGroup(g.index, g.block, bp, g.layout, g.params, GroupChunks(*g.states, param_home, slot),
                                   g.steps, g.group_of, g.compute, rt.ctx, laid,
                                   made[g.experts.index] if g.experts is not None else None, g.comm, g.version)
        made[g.index].rebind(slot)
    rt.mode.close()
    rt.take_plan([made[g.index] for g in old], plan)


def _blocks(groups: list[BlockGroup]) -> list[BlockGroup]:
    """The groups that stand for the model's blocks (not held experts'), in order."""
    experts = {g.experts.index for g in groups if g.experts is not None}
    return [g for g in groups if g.index not in experts]


def _new_plans(groups: list[BlockGroup], plan: Plan) -> dict[int, BlockPlan]:
    """Each group's plan under ``plan``: its block's, or for held experts their block's home (they never stream)."""
    out = dict(zip((g.index for g in _blocks(groups)), (*plan.blocks, plan.rest)))
    for g in groups:
        if g.experts is not None:
            out[g.experts.index] = experts_plan(out[g.index])
    return out


def _drop_compute_copies(rt: "Runtime") -> None:
    """Free every device slot and every compute copy of its own; a master that is its block's slot
    stays (it is the master)."""
    freed: set[int] = set()
    for g in rt.groups:
        if g.slot.chunk is not g.master and id(g.slot.chunk) not in freed:
            freed.add(id(g.slot.chunk))
            rt.mem.release(g.slot.chunk)
        if g.param_home is not None and g.param_home is not g.master:
            rt.mem.release(g.param_home)


def _compute_copies(rt: "Runtime", groups: list[BlockGroup], plans: dict[int, BlockPlan],
                    plan: Plan) -> dict[int, tuple[DeviceSlot, Chunk | None]]:
    """Each group's slot and param home as its new plan says, written from its master (a streamed block's
    slot is one of the ring's, filled at its first use), in block order as setup makes them."""
    ring = ring_slots(rt.mem, [g.layout for g in _blocks(groups)], plan)
    out, streamed_seen = {}, 0
    for g in groups:
        bp = plans[g.index]
        size = g.layout.numel * g.compute.itemsize
        if bp.stream:
            slot = ring[streamed_seen % len(ring)]
            streamed_seen += 1
            slot.holder = None
        elif master_in_slot(bp, plan, rt.options.train):
            slot = DeviceSlot(g.master, holder=g.index)
        else:
            slot = DeviceSlot(rt.mem.allocate(f"{g.block.name}.slot", size, Tier.DEVICE, Kind.PARAM, contiguous=True),
                              holder=g.index)
            _write_compute(g, slot.chunk)
        param_home = None
        if bp.stream and separate_param_home(bp, plan, rt.options.train):
            param_home = rt.mem.allocate(f"{g.block.name}.param", size, Tier.HOST, Kind.PARAM, contiguous=True)
            _write_compute(g, param_home)
        elif bp.stream:
            param_home = g.master
        out[g.index] = (slot, param_home)
    return out


def _write_compute(g: BlockGroup, dst: Chunk) -> None:
    """The block's master, rounded to the compute dtype, into ``dst`` (a disk master is read first)."""
    master = g.master
    if master.tier is Tier.DISK:
        values = g.mem.to_tensor(master).view(F32)[: g.layout.numel]
    else:
        values = master.typed(F32)[: g.layout.numel]
    dst.typed(g.compute)[: g.layout.numel].copy_(values)
