"""Refuse a plan whose states cannot fit the budgets, before anything is allocated.

Counts what the runtime will allocate, in whole pages per chunk, for each tier; and,
when it does not fit, says the smallest budgets this plan and the max-offload plan need.
"""

from __future__ import annotations

from tiertrain.errors import UserError
from tiertrain.memory import Budgets, Tier
from tiertrain.plan import Plan, builtin_plan
from tiertrain.plan.bytes import TRANSIENT_HINT, pieces_to_fit, tier_bytes
from tiertrain.plan.bytes import widest_read_ahead as bytes_widest
from tiertrain.runtime.blocks import Block, block_numel
from tiertrain.units import format_bytes


class PlanDoesNotFit(UserError):
    """The model's states do not fit the budgets under the plan."""


def needs(blocks: list[Block], plan: Plan, page: int, train: bool = True, transient_grads: bool = False) -> dict[Tier, int]:
    """Bytes per tier. ``transient_grads``: each block's gradients are updated away right after
    backward flushes them (overlap, no clipping, no accumulation), so only a few coexist."""
    return tier_bytes(_numels(blocks), plan, page, train, "transient" if transient_grads else "all")


def _numels(blocks: list[Block]) -> list[int]:
    return [block_numel(b) for b in blocks]


def capacities(budgets: Budgets) -> dict[Tier, int]:
    return {Tier.DEVICE: budgets.device, Tier.HOST: budgets.host, Tier.DISK: budgets.disk}


def device_need(numels: list[int], plan: Plan, page: int, train: bool, bounds_grads: bool) -> int:
    """The device bytes the runtime allocates under ``plan``, its gradients counted as it holds them
    (bounded where ``bounds_grads``, else all): what the device pool reserves of its budget, so that on
    a GPU the rest of the budget is there for the activations the planner counted in it."""
    return tier_bytes(numels, plan, page, train, "transient" if train and bounds_grads else "all")[Tier.DEVICE]


def _short(need: dict[Tier, int], budgets: Budgets) -> list[Tier]:
    have = capacities(budgets)
    return [t for t in need if need[t] > have[t]]


def widest_read_ahead(blocks: list[Block], plan: Plan, budgets: Budgets, page: int,
                      transient_grads: bool = False) -> Plan:
    """``plan.bytes.widest_read_ahead`` for this model's blocks under these budgets."""
    return bytes_widest(_numels(blocks), plan, page, capacities(budgets), "transient" if transient_grads else "all")


def fits(blocks: list[Block], plan: Plan, budgets: Budgets, page: int, train: bool = True,
         transient_grads: bool = False) -> bool:
    return not _short(needs(blocks, plan, page, train=train, transient_grads=transient_grads), budgets)


def check_fits(blocks: list[Block], plan: Plan, budgets: Budgets, page: int, train: bool = True,
               transient_grads: bool = False) -> None:
    need = needs(blocks, plan, page, train=train, transient_grads=transient_grads)
    have = capacities(budgets)
    short = _short(need, budgets)
    if not short:
        return
    best = needs(blocks, builtin_plan("max-offload", len(plan.blocks), disk=True), page, train=train,
                 transient_grads=transient_grads)
    detail = ", ".join(f"{t.value} needs {format_bytes(need[t])} (budget {format_bytes(have[t])})" for t in short)
    smallest = f"plan {plan.name!r} does not fit: {detail}. Smallest budgets for this plan: {_budgets(need)}"
    if any(best[t] < need[t] for t in need):  # the fallback helps only where it needs less
        smallest += f"; with plan 'max-offload' and a disk: {_budgets(best)}"
    if train and not transient_grads and fits(blocks, plan, budgets, page, transient_grads=True):
        smallest += f". It fits as it is when {TRANSIENT_HINT}"
    elif train and not transient_grads and _fits_in_pieces(blocks, plan, budgets, page):
        smallest += (f". It fits with its disk-homed blocks updated in pieces (their gradients then wait on the "
                     f"device, a few at a time) when {TRANSIENT_HINT}")
    raise PlanDoesNotFit(smallest)


def _fits_in_pieces(blocks: list[Block], plan: Plan, budgets: Budgets, page: int) -> bool:
    """Whether the plan fits once ``pieces_to_fit`` cuts it, with gradients updated away as they come."""
    cut = pieces_to_fit(_numels(blocks), plan, page, capacities(budgets), "transient")
    return cut is not plan and fits(blocks, cut, budgets, page, transient_grads=True)


def _budgets(need: dict[Tier, int]) -> str:
    return ", ".join(f"{t.value} {format_bytes(need[t], up=True)}" for t in (Tier.DEVICE, Tier.HOST, Tier.DISK))
