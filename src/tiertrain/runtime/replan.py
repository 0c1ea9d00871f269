"""A new plan taking effect at a step boundary: every state moved to the tier the plan names, the
device slots and compute copies rebuilt, the same parameter objects re-pointed at them.

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
from tiertrain.plan import Plan
from tiertrain.plan.bytes import master_in_slot, separate_param_home, state_homes
from tiertrain.runtime.block_group import F32, BlockGroup
from tiertrain.runtime.budget_check import device_need
from tiertrain.runtime.build import ring_slots
from tiertrain.runtime.cache import DeviceCache
from tiertrain.runtime.modes import make_mode
from tiertrain.runtime.slots import Slot, rebind
from tiertrain.runtime.state_moves import StateMoves
from tiertrain.units import format_bytes

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime

_MOVE_ORDER = (Tier.DISK, Tier.DEVICE, Tier.HOST)


def replan(rt: "Runtime", plan: Plan, transient_grads: bool) -> None:
    """Run ``rt`` under ``plan`` from the next step on (call between steps; training runs only)."""
    if not rt.options.train:
        raise ValueError("replan moves optimizer states; a forward-only run has none to move")
    plan = plan.validate(len(rt.groups) - 1)
    _check_device_room(rt, plan, transient_grads)
    rt.wait_updates()
    rt.cache.settle()
    for g in rt.groups:
        g.release()
    _drop_compute_copies(rt)
    for g, bp in zip(rt.groups, (*plan.blocks, plan.rest)):
        g.plan = bp
    rt.plan = plan
    for tier in _MOVE_ORDER:
        for g in rt.groups:
            for chunk, home in zip(g.states, state_homes(g.plan)):
                if home is tier and chunk.tier is not tier:
                    rt.mem.move(chunk, tier, contiguous=True).wait()
    ring = ring_slots(rt.mem, [g.layout for g in rt.groups], plan)
    _compute_copies(rt, ring)
    rt.mode.close()
    rt.moves = StateMoves(rt.mem, plan.read_ahead)
    rt.mode = make_mode(rt)
    rt.cache = DeviceCache([g for g in rt.groups if g.plan.stream], ring, rt.mem.mover, plan.prefetch,
                           ready=rt.params_ready)
    rt.transient_grads = transient_grads
    rt.wire()


def _check_device_room(rt: "Runtime", plan: Plan, transient_grads: bool) -> None:
    """A device pool maps what its run's plan counts (``tiertrain.setup``), or its whole budget where
    the run replans (plan auto's first step) or has several ranks: the new plan must fit what it maps."""
    pool = rt.mem.pool(Tier.DEVICE)
    need = device_need([g.layout.numel for g in rt.groups], plan, pool.page_size, True, transient_grads)
    if need > pool.capacity:
        raise ValueError(f"plan {plan.name!r} needs {format_bytes(need)} of device and this run's device pool "
                         f"maps {format_bytes(pool.capacity)}: setup reserved what its own plan counts; a run that "
                         "replans must be planned from its own first step (plan 'auto' without profile_step: its "
                         "pool keeps the whole budget)")


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
        g.param_home = None


def _compute_copies(rt: "Runtime", ring: list[Slot]) -> None:
    """Each block's slot and param home as the plan says, written from its master, and its parameters
    re-pointed at the slot (a streamed block's slot is filled at its first use)."""
    plan, streamed_seen = rt.plan, 0
    for g in rt.groups:
        size = g.layout.numel * g.compute.itemsize
        if g.plan.stream:
            slot = ring[streamed_seen % len(ring)]
            streamed_seen += 1
            slot.holder = None
        elif master_in_slot(g.plan, plan, rt.options.train):
            slot = Slot(g.master, holder=g.index)
        else:
            slot = Slot(rt.mem.allocate(f"{g.block.name}.slot", size, Tier.DEVICE, Kind.PARAM, contiguous=True),
                        holder=g.index)
            _write_compute(g, slot.chunk)
        if g.plan.stream and separate_param_home(g.plan, plan, rt.options.train):
            g.param_home = rt.mem.allocate(f"{g.block.name}.param", size, Tier.HOST, Kind.PARAM, contiguous=True)
            _write_compute(g, g.param_home)
        elif g.plan.stream:
            g.param_home = g.master
        rebind(g, slot)


def _write_compute(g: BlockGroup, dst) -> None:
    """The block's master, rounded to the compute dtype, into ``dst`` (a disk master is read first)."""
    master = g.master
    if master.tier is Tier.DISK:
        values = g.mem.to_tensor(master).view(F32)[: g.layout.numel]
    else:
        values = master.typed(F32)[: g.layout.numel]
    dst.typed(g.compute)[: g.layout.numel].copy_(values)
