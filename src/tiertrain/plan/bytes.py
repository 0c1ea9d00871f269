"""Where each of a block's chunks lives under a plan, and how many bytes a chunk takes in a pool: the
placement rules the runtime builds by and the counts in ``plan.fit`` add up. Whether a plan fits is
decided in ``plan.fit`` alone. Imports nothing from the runtime or the planner.
"""

from __future__ import annotations

import dataclasses

from tiertrain.plan.plan import BlockPlan, Plan
from tiertrain.plan.tiers import Tier
from tiertrain.plan.update_modes import fixed_lag, rules

F32_BYTES = 4


def pages(nbytes: int, page: int, bound: bool = True) -> int:
    """Bytes a chunk of ``nbytes`` occupies in a pool of ``page``-byte pages (0: unpaged). The
    bound adds the page a chunk may share with the one before it; without it, the likely figure
    (a chunk's share of a shared page is as often zero as not)."""
    if page <= 0:
        return nbytes
    return -(-nbytes // page) * page + (page if bound else 0)


MIN_PAGE = 4096     # the O_DIRECT alignment: no page is smaller


def sharded(bp: BlockPlan, plan: Plan) -> bool:
    """Whether a block's states and gradients are split over data-parallel ranks."""
    return bp.shard and plan.parallel.dp > 1


def separate_param_home(bp: BlockPlan, plan: Plan, train: bool = True) -> bool:
    """Whether a streamed (or sharded) block keeps its compute params in a host chunk of their own;
    else its fp32 master is what its device slot is filled (gathered) from, wherever the master lives
    (disk too). A master that travels between disk and host is no source for a lockfree forward (an
    update may have it in flight), nor for ``param_copy``'s; one kept on the host is, as a
    host-homed block's is, except at a fixed lag, where the master runs a step ahead of the params."""
    return (not train or plan.compute_dtype != "fp32" or fixed_lag(plan)
            or (master_home(bp) is Tier.DISK and (bp.param_copy or rules(plan.update).loops)))


def master_in_slot(bp: BlockPlan, plan: Plan, train: bool = True) -> bool:
    """Whether a block's fp32 master *is* its device slot: a resident fp32 block whose states live
    on the device is updated in place, as plain PyTorch updates its parameters, instead of keeping
    a second fp32 copy and copying it into the slot after every update (not at a fixed lag, whose master
    runs a step ahead of the params the slot holds)."""
    return (train and not bp.stream and bp.home is Tier.DEVICE and plan.compute_dtype == "fp32"
            and not sharded(bp, plan) and not fixed_lag(plan))


def master_home(bp: BlockPlan) -> Tier:
    """Where a block's fp32 master lives between steps: at its home, but a disk-homed block's on the
    host where ``host_master`` says so."""
    return Tier.HOST if bp.host_master and bp.home is Tier.DISK else bp.home


def state_homes(bp: BlockPlan) -> tuple[Tier, Tier, Tier]:
    """Where a block's master, exp_avg and exp_avg_sq live between steps."""
    return master_home(bp), bp.home, bp.home


def disk_states(bp: BlockPlan) -> int:
    """How many of a block's three fp32 states live on disk (and cross to the host for its update)."""
    return sum(t is Tier.DISK for t in state_homes(bp))


def in_pieces(bp: BlockPlan) -> bool:
    """Whether a block's update streams its disk-homed states through host piece by piece."""
    return bp.piece > 0 and bp.home is Tier.DISK


def grad_tier(bp: BlockPlan) -> Tier:
    """Where a block's gradients gather: beside its master, where its update runs. A device-homed
    block is updated on the device, so its gradients never cross the host link; the others go to
    the host, where the CPU optimizer (or the disk states' reader) takes them, except a block updated
    in pieces: its gradients wait on the device and cross to the host a piece at a time, so the host
    holds pieces only (ZeRO-Infinity's gradient buckets, per piece)."""
    return Tier.DEVICE if bp.home is Tier.DEVICE or in_pieces(bp) else Tier.HOST


def updated_away(bp: BlockPlan) -> bool:
    """Whether a block's gradients are among those a transient run bounds (``transient``): the ones
    the CPU optimizer takes, in host or (updated in pieces) on the device. A device-homed block's
    stay until its update on the device, counted in full."""
    return bp.home is not Tier.DEVICE


REDUCTIONS_IN_FLIGHT = 1  # data parallel: a block's reduction runs under the next block's backward (runtime.reduction)


def reductions_in_flight(hybrid: bool) -> int:
    """Reductions in flight beside the one starting: one (it runs under the next block's backward), two
    with hybrid sharding (the shard's all-reduce across the nodes, issued once the reduce-scatter inside
    the node has landed, runs under the backward of the block after that)."""
    return REDUCTIONS_IN_FLIGHT + (1 if hybrid else 0)


def reduce_staging(full: list[int], parts: list[int], dp: int, page: int, bound: bool = True,
                   in_flight: int = REDUCTIONS_IN_FLIGHT, once_a_step: bool = False) -> int:
    """Bytes data parallel's gradient reductions take at once (``dp`` > 1) where they are staged
    (``Plan.reduce_on``): the stage of the block whose backward runs and of each reduction in flight
    (``in_flight``), each a whole block's gradients in the reduce dtype (``full``), and beside a sharded one
    the shard it is reduce-scattered into (``parts``, 0: none apart), for the largest block. Reduced once a
    step (``Plan.reduce_every``), every block's stage is held from its first micro-batch to its reduction, and
    every block's reduction may be in flight at once (they land as the step begins: ``runtime.backward``)."""
    if dp == 1 or not full:
        return 0
    if once_a_step:
        return sum(pages(f, page, bound) + (pages(s, page, bound) if s else 0) for f, s in zip(full, parts))
    return (in_flight + 1) * max(pages(f, page, bound) + (pages(s, page, bound) if s else 0)
                                 for f, s in zip(full, parts))


PIECE_BUFFERS = 3  # per update worker: the piece being read, the one being updated, the one being written


def piece_bytes(nbytes: int, bp: BlockPlan) -> int:
    """Bytes of one state piece of a block whose states are ``nbytes`` each (never more than them)."""
    return min(nbytes, bp.piece)


def experts_plan(bp: BlockPlan) -> BlockPlan:
    """Where a block's held experts live (expert parallel): at the block's home, in a device slot of their
    own (they do not stream: the window holds blocks), never sharded (each rank holds whole experts), with
    no activation switches of their own (their block's forward runs them)."""
    return dataclasses.replace(bp, stream=False, shard=False, recompute=False, offload_hidden=False, param_copy=False)
