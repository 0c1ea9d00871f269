"""Refuse a plan whose states cannot fit the budgets, before anything is allocated.

Counts what the runtime will allocate, in whole pages per chunk, for each tier; and,
when it does not fit, says the smallest budgets this plan and the max-offload plan need.
"""

from __future__ import annotations

from tiertrain.errors import UserError
from tiertrain.memory import Budgets, ChunkLayout, Tier
from tiertrain.runtime.blocks import Block
from tiertrain.plan import Plan, builtin_plan
from tiertrain.units import format_bytes

F32_BYTES = 4


class PlanDoesNotFit(UserError):
    """The model's states do not fit the budgets under the plan."""


def _pages(nbytes: int, page: int) -> int:
    return -(-nbytes // page) * page + page  # +1 page: a chunk may start in a shared page


def needs(blocks: list[Block], plan: Plan, page: int, train: bool = True, transient_grads: bool = False) -> dict[Tier, int]:
    """Bytes per tier. ``transient_grads``: each block's gradients are updated away right after
    backward flushes them (overlap, no clipping, no accumulation), so only a few coexist."""
    numels = [ChunkLayout.build([(n, tuple(p.shape)) for n, p in b.params]).numel for b in blocks]
    sizes = [n * F32_BYTES for n in numels]                        # master, moments, grads: fp32
    compute = [n * plan.compute.itemsize for n in numels]          # slots and param homes
    plans = list(plan.blocks) + [plan.rest]
    need = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    streamed = [c for c, p in zip(compute, plans) if p.stream]
    if streamed:
        need[Tier.DEVICE] += min(plan.window + plan.cache, len(streamed)) * _pages(max(streamed), page)
    for size, csize, bp in zip(sizes, compute, plans):
        if not bp.stream:
            need[Tier.DEVICE] += _pages(csize, page)
        elif (not train or plan.compute_dtype != "fp32"
              or (bp.home is Tier.DISK and (bp.param_copy or plan.update == "lockfree"))):
            need[Tier.HOST] += _pages(csize, page)       # a host param home (else the master is it)
        if train:
            need[Tier.HOST] += 0 if transient_grads else _pages(size, page)  # grads
            need[bp.home] += 3 * _pages(size, page)      # master, exp_avg, exp_avg_sq
    if not train:
        return need
    if transient_grads:  # one per optimizer worker, plus the one backward is filling
        need[Tier.HOST] += (plan.update_workers + 1) * _pages(max(sizes), page)
    disk_sizes = sorted((s for s, p in zip(sizes, plans) if p.home is Tier.DISK), reverse=True)
    # states in host for updates: read ahead, being updated, being written back (one per worker)
    held = plan.read_ahead + 2 * plan.update_workers
    need[Tier.HOST] += sum(3 * _pages(s, page) for s in disk_sizes[:held])
    return need


def check_fits(blocks: list[Block], plan: Plan, budgets: Budgets, page: int, train: bool = True,
               transient_grads: bool = False) -> None:
    need = needs(blocks, plan, page, train=train, transient_grads=transient_grads)
    have = {Tier.DEVICE: budgets.device, Tier.HOST: budgets.host, Tier.DISK: budgets.disk}
    short = [t for t in need if need[t] > have[t]]
    if not short:
        return
    best = needs(blocks, builtin_plan("max-offload", len(plan.blocks), disk=True), page, train=train)
    detail = ", ".join(f"{t.value} needs {format_bytes(need[t])} (budget {format_bytes(have[t])})" for t in short)
    raise PlanDoesNotFit(
        f"plan {plan.name!r} does not fit: {detail}. Smallest budgets for this plan: "
        f"device {format_bytes(need[Tier.DEVICE])}, host {format_bytes(need[Tier.HOST])}, disk {format_bytes(need[Tier.DISK])}; "
        f"with plan 'max-offload' and a disk: device {format_bytes(best[Tier.DEVICE])}, host {format_bytes(best[Tier.HOST])}, "
        f"disk {format_bytes(best[Tier.DISK])}"
    )
