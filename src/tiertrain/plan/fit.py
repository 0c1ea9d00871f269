"""Whether a plan fits: the one module that counts what a plan holds in each tier, holds it against the
budgets, and resolves a plan into the one that runs.

The counts come from the chunks' sizes alone (``Sizes``), with the placement rules of ``plan.bytes``
(which tier each chunk lives in) and the update modes' rules (``plan.update_modes``): the runtime's
setup, a plan taking effect after the first step, the device pool's size, the planner's search and its
simulator all ask here, so a plan the planner predicts to fit is the plan the runtime accepts, and a
refusal says the same thing wherever it comes from. Chunks are allocated in whole pages, plus one page
because a chunk may start inside a page another one shares.

``resolve`` writes every decision derived from the sizes, the budgets and the run's options into the
plan (``Plan.resolved``, the pieces, the read-ahead): setup, the first-step auto plan and a replan run
exactly the plan it returns, and the planner simulates exactly that plan.
Imports nothing from the runtime or the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiertrain.errors import ConfigError, UserError
from tiertrain.plan.budgets import Budgets
from tiertrain.plan.bytes import (F32_BYTES, MIN_PAGE, PIECE_BUFFERS, disk_states, experts_plan, reductions_in_flight,
                                  grad_tier, in_pieces, master_in_slot, pages, piece_bytes, reduce_staging,
                                  separate_param_home, sharded, state_homes, updated_away)
from tiertrain.plan.plan import BlockPlan, Plan, Resolved, builtin_plan
from tiertrain.plan.tiers import Tier
from tiertrain.plan.update_modes import fixed_lag, grad_copies, transient
from tiertrain.precisions import BYTES
from tiertrain.units import format_bytes

# what makes a run's gradients "transient", in the words of the flags, for refusals to suggest
TRANSIENT_HINT = ("each block's gradients are updated away as backward makes them, so the host holds a few, "
                  "not all: --update overlap --grad-clip 0 (no clipping, no gradient accumulation)")
MAX_PAGE_WASTE = 0.10
MAX_PIECE = 64 << 20  # the largest piece tried: a few large reads in flight per state, a few buffers per worker


class PlanDoesNotFit(UserError):
    """The model's states do not fit the budgets under the plan."""


class BeyondMachine(UserError):
    """A budget larger than what the machine has."""


@dataclass(frozen=True)
class Sizes:
    """What a model's blocks hold, as the counts need it: the elements of each block's chunks (padding
    included: the repeated blocks, then the rest) and, under expert parallel, of the experts this rank
    holds of each block (a group of their own beside the block's; 0 where a block has none)."""

    numels: tuple[int, ...]
    experts: tuple[int, ...] = ()

    def held(self) -> list[tuple[int, int]]:
        """(block index, elements) of every block's held experts."""
        return [(i, n) for i, n in enumerate(self.experts) if n]


def sizes_of(sizes: "Sizes | Sequence[int]") -> Sizes:
    """``sizes`` as ``Sizes`` (a plain list of each block's elements has no experts)."""
    return sizes if isinstance(sizes, Sizes) else Sizes(tuple(sizes))


def _chunks(sizes: Sizes, plan: Plan) -> tuple[list[int], list[BlockPlan]]:
    """Each group's elements and plan: the blocks and the rest, then every block's held experts at the
    block's home (``plan.bytes.experts_plan``)."""
    bplans = [*plan.blocks, plan.rest]
    if len(sizes.numels) != len(bplans):
        raise ValueError(f"{len(sizes.numels)} chunk sizes for a plan of {len(plan.blocks)} blocks + rest")
    held = sizes.held()
    return list(sizes.numels) + [n for _, n in held], bplans + [experts_plan(bplans[i]) for i, _ in held]


def page_for_states(numels: Sequence[int], page: int, max_waste: float = MAX_PAGE_WASTE) -> int:
    """The largest page size up to ``page`` (halving from it) whose whole-page rounding of the blocks'
    fp32 state chunks, as the budget check counts it (with the page a chunk may share), wastes at
    most ``max_waste`` of their bytes. A measured page size (megabytes, for bandwidth) would otherwise
    give a small model's every chunk a page of its own: a 100K-param model asked for 640 MiB of
    device. And 8 MiB pages counted a 354M GPT's 48 MiB chunks as 64 MiB each: a third of the host
    budget not spent on states, where 2 MiB pages cost 0.02 CPU-s per GB more here. Never below 4 KiB."""
    sizes = [n * F32_BYTES for n in numels if n]
    total = sum(sizes)
    while page > MIN_PAGE and sum(pages(s, page) - s for s in sizes) > max_waste * total:
        page = max(MIN_PAGE, page // 2 // MIN_PAGE * MIN_PAGE)
    return page


def staging_bytes(sizes: Sequence[int], plans: Sequence[BlockPlan], workers: int, page: int,
                  bound: bool = True) -> int:
    """Host bytes the piecewise updates hold: per worker, ``PIECE_BUFFERS`` pieces of each state that
    lives on disk, at the largest such set of any block updated in pieces (0 if none is)."""
    sets = [(disk_states(p), piece_bytes(s, p)) for s, p in zip(sizes, plans) if in_pieces(p)]
    return max((piece_buffer_bytes(n, workers, page, bound, k) for k, n in sets), default=0)


def piece_buffer_bytes(largest: int, workers: int, page: int, bound: bool = True, states: int = 3) -> int:
    """Host bytes of the piecewise updates' buffers with ``largest``-byte pieces of ``states`` disk
    states (0: none)."""
    return workers * PIECE_BUFFERS * states * pages(largest, page, bound) if largest else 0


def bounded_grads(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, bound: bool = True) -> dict[Tier, int]:
    """Per tier, the gradient bytes a run that bounds its gradients (``bounds_grads``) holds at most of
    the blocks whose updates take them away (``updated_away``): ``alive_grad_bytes`` of their chunks."""
    numels, plans = _chunks(sizes_of(sizes), plan)
    dp, split = plan.parallel.dp, plan.parallel.shard_ranks
    out: dict[Tier, int] = {}
    for tier in (Tier.HOST, Tier.DEVICE):
        away = [(n * F32_BYTES, p) for n, p in zip(numels, plans) if updated_away(p) and grad_tier(p) is tier]
        if away:
            own = [-(-f // split) if sharded(p, plan) else f for f, p in away]
            out[tier] = alive_grad_bytes(own, plan.update_workers, dp, page, bound)
    return out


def grad_floors(own: Sequence[int], dp: int) -> tuple[int, int]:
    """The layout of one tier's bounded grad chunks (``own``: this rank's bytes of each): (the size a
    chunk takes, the size kept at the pool's far end). Chunks of mixed sizes (a wide embedding's beside
    the blocks') fragment a pool until a contiguous one no longer fits a budget that holds its bytes:
    so in one process the largest size goes to the far end of the pool and every other chunk is as
    large as the largest of the others; over several ranks every chunk is as large as the largest (a
    micro-batch's part lands in a fresh chunk beside the block's sum). The runtime lays them out so
    (``Runtime.wire``), ``alive_grad_bytes`` counts them so."""
    top = max(own)
    if dp > 1:
        return top, 0
    return max((n for n in own if n < top), default=0), top


def alive_grad_bytes(own: Sequence[int], workers: int, dp: int, page: int, bound: bool = True) -> int:
    """What ``workers + 1`` bounded grad chunks take at most, laid out as ``grad_floors`` says: in one
    process a slot at the far end for each chunk of the largest size that may be alive, the others each
    as large as the largest of them; over several ranks that many of the largest."""
    alive = workers + 1
    mine, top = grad_floors(own, dp)
    if dp > 1:
        return alive * pages(mine, page, bound)
    rest = sum(1 for n in own if n < top)
    return min(alive, len(own) - rest) * pages(top, page, bound) + min(alive, rest) * pages(mine, page, bound)


def has_own_place(own: int, others: Sequence[int]) -> bool:
    """Whether, in one process, ``alive_grad_bytes`` lays out a chunk of ``own`` bytes in a place no chunk
    of ``others`` (the other bounded chunks of its tier) can take: its size is the largest and no other
    has it, or it is the only one smaller than the largest."""
    top = max([*others, own])
    return own not in others if own == top else all(o == top for o in others)


def tier_bytes(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, train: bool = True, grads: str = "all",
               bound: bool = True) -> dict[Tier, int]:
    """Bytes per tier for blocks of ``sizes`` (each block's elements, the repeated blocks then the rest,
    and their held experts' where there are any).

    ``grads``: ``all`` holds every block's gradient chunks (``grad_tier``, ``grad_copies``);
    ``transient`` holds only one host chunk per update worker plus the one backward fills (overlap
    without clipping or accumulation updates each block's gradients away at once), and
    device-homed blocks' chunks in full; ``none`` leaves gradients out (the simulator adds them on
    its timeline).
    """
    numels, plans = _chunks(sizes_of(sizes), plan)
    dp, split = plan.parallel.dp, plan.parallel.shard_ranks  # ranks; ranks a sharded block is split over
    full = [n * F32_BYTES for n in numels]                         # a rank's own gradients before they are reduced
    state = [-(-f // split) if sharded(p, plan) else f for f, p in zip(full, plans)]  # master, moments, grads: fp32
    compute = [n * BYTES[plan.compute_dtype] for n in numels]          # slots
    homes = [-(-c // split) if sharded(p, plan) else c for c, p in zip(compute, plans)]  # param homes

    def chunk(nbytes: int) -> int:
        return pages(nbytes, page, bound)

    need = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    copies = grad_copies(plan.update, plan.max_staleness)
    streamed = [c for c, p in zip(compute, plans) if p.stream]
    if streamed:
        need[Tier.DEVICE] += min(plan.window + plan.cache, len(streamed)) * chunk(max(streamed))
    for size, csize, home, f, bp in zip(state, compute, homes, full, plans):
        if not bp.stream and not master_in_slot(bp, plan, train):
            need[Tier.DEVICE] += chunk(csize)
        if (bp.stream or sharded(bp, plan)) and separate_param_home(bp, plan, train):
            need[Tier.HOST] += chunk(home)
        if train:
            if grads == "all" or (grads == "transient" and not updated_away(bp)):
                need[grad_tier(bp)] += copies * chunk(size)
            for tier in state_homes(bp):      # master (the slot, where master_in_slot), exp_avg, exp_avg_sq
                need[tier] += chunk(size)
    if not train:
        return need
    if grads != "none":  # a micro-batch's gradients reduced over the ranks where they are staged (``reduce_on``)
        size, unit = BYTES[plan.reduce_dtype], split * 64  # a layout pads to split x 64 elements (memory.layout)
        staged = [-(-n // unit) * unit * size for n in numels]

        def apart(bp: BlockPlan) -> bool:  # else reduce-scattered straight into the fresh grad chunk
            return plan.reduce_on == "device" or plan.reduce_dtype != "fp32" or grad_tier(bp) is not Tier.HOST
        parts = [s // split if sharded(p, plan) and apart(p) else 0 for s, p in zip(staged, plans)]
        in_flight = reductions_in_flight(plan.parallel.hybrid)
        need[Tier(plan.reduce_on)] += reduce_staging(staged, parts, dp, page, bound, in_flight,
                                                     plan.reduce_every == "step")
        # reduced once a step, a reduction lands in a block's first grad chunk of the step, counted above where
        # every block's gradients are held; else every block's may be in flight at once
        once = plan.reduce_every == "step"
        for tier, (largest, every) in _landing(state, plans, dp, chunk).items():
            need[tier] += (0 if grads == "all" else every) if once else (in_flight + 1) * largest
    if grads == "transient":
        for tier, nbytes in bounded_grads(sizes, plan, page, bound).items():
            need[tier] += nbytes
    on_disk = sorted((disk_states(p) * chunk(s) for s, p in zip(state, plans)
                      if p.home is Tier.DISK and not in_pieces(p)), reverse=True)
    # states in host for updates: read ahead, being updated, being written back (one per worker)
    held = plan.read_ahead + 2 * plan.update_workers
    need[Tier.HOST] += sum(on_disk[:held])
    need[Tier.HOST] += staging_bytes(state, plans, plan.update_workers, page, bound)
    return need


def _landing(state: list[int], plans: list[BlockPlan], dp: int, chunk: Callable[[int], int]
             ) -> dict[Tier, tuple[int, int]]:
    """Data parallel: per gradient tier, the largest part of a block a reduction lands in a fresh chunk
    beside the block's sum (one per reduction in flight, and the one starting), and every block's together."""
    out: dict[Tier, tuple[int, int]] = {}
    if dp > 1:
        for size, bp in zip(state, plans):
            largest, every = out.get(grad_tier(bp), (0, 0))
            out[grad_tier(bp)] = (max(largest, chunk(size)), every + chunk(size))
    return out


def over_budgets(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets, grads: str = "all"
                 ) -> dict[Tier, int]:
    """The tiers where ``plan`` needs more than ``budgets`` give, and what it needs there (``tier_bytes``)."""
    need = tier_bytes(sizes, plan, page, grads=grads)
    return {t: n for t, n in need.items() if n > budgets[t]}


def fits_budgets(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets, grads: str = "all") -> bool:
    """Whether ``plan`` fits every budget, its gradients counted as ``grads`` says (``tier_bytes``)."""
    need = tier_bytes(sizes, plan, page, grads=grads)
    return all(need[t] <= budgets[t] for t in need)


def pieces_to_fit(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets, grads: str = "all") -> Plan:
    """Where the host cannot hold the states of the blocks whose updates it holds at once, the plan
    with its larger disk-homed blocks updated in pieces (``in_pieces``): the largest piece, halving
    from ``MAX_PIECE`` in whole pages, with which the plan fits every budget (the pieces' gradients
    wait on the device). A plan whose host fits, or that names its pieces already, is returned as it
    is, and so is one no piece size makes fit (the budget check then says what it needs), and one at a
    fixed lag, whose updates hold a block's master whole (``Plan.fixed_lag``)."""
    if fixed_lag(plan) or not plan.uses_disk or any(b.piece for b in (*plan.blocks, plan.rest)):
        return plan
    if tier_bytes(sizes, plan, page, grads=grads)[Tier.HOST] <= budgets[Tier.HOST]:
        return plan
    piece = max(page, MAX_PIECE // page * page)
    while True:
        pieced = cut_in_pieces(sizes, plan, piece)
        if fits_budgets(sizes, pieced, page, budgets, grads):
            return pieced
        if piece <= page:
            return plan
        piece = max(page, piece // 2 // page * page)


def cut_in_pieces(sizes: "Sizes | Sequence[int]", plan: Plan, piece: int) -> Plan:
    """The plan with each disk-homed block whose states are larger than ``piece`` bytes updated in
    pieces of that size (``in_pieces``)."""
    numels = sizes_of(sizes).numels

    def cut(bp: BlockPlan, n: int) -> BlockPlan:
        big = bp.home is Tier.DISK and n * F32_BYTES > piece
        return dataclasses.replace(bp, piece=piece) if big else bp
    return dataclasses.replace(plan, blocks=tuple(cut(b, n) for b, n in zip(plan.blocks, numels)),
                               rest=cut(plan.rest, numels[-1]))


def widest_read_ahead(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets,
                      grads: str = "all") -> Plan:
    """The plan with as many disk-homed blocks read ahead as the host budget holds (never fewer than
    it asks for). Reading states in ahead keeps the disk busy through forward and backward instead of
    only after each block's backward; measured on the offload bench (stream-disk, overlap): 0.555 s
    per step with 2 blocks ahead, 0.496 s with all 8. The host memory the user gave is spent on that
    rather than left idle. Applied before a plan is simulated, so the plan that runs is the one whose
    prediction is printed."""
    on_disk = sum(b.home is Tier.DISK for b in (*plan.blocks, plan.rest))
    best = plan
    for k in range(plan.read_ahead + 1, on_disk + 1):
        wider = dataclasses.replace(plan, read_ahead=k)
        if not fits_budgets(sizes, wider, page, budgets, grads):
            break
        best = wider
    return best


def host_masters(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets, grads: str = "all") -> Plan:
    """The plan with the host it leaves spent where that spares the most disk traffic per byte: first
    disk-homed blocks' masters on the host (``host_master``: 4 B a parameter spare the update's 4 B
    read and 4 B write of it, and for a streamed fp32 block both 4 B reads of its compute params),
    those sparing most first, the largest first; then, with host to spare, their whole states (8 B
    more spare the moments' 16 B). Each is kept where the plan still fits. Host-homed blocks stay
    (the planner tries them on disk as a plan of its own, ``planner.auto._widened``): sending one to
    disk frees its states but stages them for its update."""
    plans, numels = list((*plan.blocks, plan.rest)), sizes_of(sizes).numels

    def with_(trial: list[BlockPlan]) -> Plan:
        return dataclasses.replace(plan, blocks=tuple(trial[:-1]), rest=trial[-1])

    def spares(i: int) -> int:
        return 16 if plans[i].stream and not separate_param_home(plans[i], plan) else 8

    def kept(i: int, **change) -> None:
        nonlocal plans
        trial = plans[:i] + [dataclasses.replace(plans[i], **change)] + plans[i + 1:]
        if fits_budgets(sizes, with_(trial), page, budgets, grads):
            plans = trial

    on_disk = [i for i, bp in enumerate(plans) if bp.home is Tier.DISK]
    for i in sorted(on_disk, key=lambda i: (-spares(i), -numels[i])):
        kept(i, host_master=True)
    for i in sorted((i for i in on_disk if plans[i].host_master), key=lambda i: numels[i]):
        kept(i, home=Tier.HOST, host_master=False, piece=0)
    return with_(plans)


def bounds_grads(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets, transient: bool) -> bool:
    """Whether backward must wait for updates to free gradient chunks: the run updates gradients away
    as they come (``transient``: overlap, no clipping, no accumulation) and the budgets cannot hold
    them all. Only then does the runtime bound them; elsewhere it never makes backward wait."""
    return transient and not fits_budgets(sizes, plan, page, budgets)


def widen_read_ahead(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets,
                     transient: bool) -> Plan:
    """``widest_read_ahead`` with the gradients counted as the runtime will hold them: all of them,
    unless they do not all fit (``bounds_grads``). The planner applies it to each plan before
    simulating it, and setup to a plan it was given, so the plan that runs is the simulated one."""
    return widest_read_ahead(sizes, plan, page, budgets, grads_held(sizes, plan, page, budgets, transient))


def grads_held(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets, transient: bool) -> str:
    """How ``tier_bytes`` counts the gradients the runtime will hold under ``plan``: ``transient`` where
    it bounds them (``bounds_grads``), else ``all``."""
    return "transient" if bounds_grads(sizes, plan, page, budgets, transient) else "all"


# -- the decisions ------------------------------------------------------------------------------
def short(need: dict[Tier, int], budgets: Budgets) -> list[Tier]:
    """The tiers where ``need`` exceeds the budget."""
    return [t for t in need if need[t] > budgets[t]]


def fits(sizes: "Sizes | Sequence[int]", plan: Plan, budgets: Budgets, page: int, train: bool = True,
         grads: str = "all") -> bool:
    return not short(tier_bytes(sizes, plan, page, train, grads), budgets)


def check_fits(sizes: "Sizes | Sequence[int]", plan: Plan, budgets: Budgets, page: int, train: bool = True,
               transient_grads: bool = False) -> None:
    """Refuse a plan that does not fit, with the smallest budgets it would fit, and what else would."""
    grads = "transient" if transient_grads else "all"
    need = tier_bytes(sizes, plan, page, train, grads)
    missing = short(need, budgets)
    if not missing:
        return
    best = tier_bytes(sizes, builtin_plan("max-offload", len(plan.blocks), disk=True), page, train, grads)
    detail = ", ".join(f"{t.value} needs {format_bytes(need[t])} (budget {format_bytes(budgets[t])})" for t in missing)
    smallest = f"plan {plan.name!r} does not fit: {detail}. Smallest budgets for this plan: {_budgets(need)}"
    if any(best[t] < need[t] for t in need):  # the fallback helps only where it needs less
        smallest += f"; with plan 'max-offload' and a disk: {_budgets(best)}"
    if train and not transient_grads and fits(sizes, plan, budgets, page, grads="transient"):
        smallest += f". It fits as it is when {TRANSIENT_HINT}"
    elif train and not transient_grads and _fits_in_pieces(sizes, plan, budgets, page):
        smallest += (f". It fits with its disk-homed blocks updated in pieces (their gradients then wait on the "
                     f"device, a few at a time) when {TRANSIENT_HINT}")
    raise PlanDoesNotFit(smallest)


def _fits_in_pieces(sizes: "Sizes | Sequence[int]", plan: Plan, budgets: Budgets, page: int) -> bool:
    """Whether the plan fits once ``pieces_to_fit`` cuts it, with gradients updated away as they come."""
    cut = pieces_to_fit(sizes, plan, page, budgets, "transient")
    return cut is not plan and fits(sizes, cut, budgets, page, grads="transient")


def _budgets(need: dict[Tier, int]) -> str:
    return ", ".join(f"{t.value} {format_bytes(need[t], up=True)}" for t in (Tier.DEVICE, Tier.HOST, Tier.DISK))


def resolve(plan: Plan, sizes: "Sizes | Sequence[int]", budgets: Budgets, page: int, *, train: bool = True,
            needs_all_grads: bool = False) -> Plan:
    """The plan as it runs under ``budgets``, every decision derived from the sizes, the budgets and the
    run's options written into it; ``PlanDoesNotFit`` (naming the smallest budgets) where it cannot fit.

    Where the host cannot hold whole disk-homed blocks' states for their updates, they are updated in
    pieces (``pieces_to_fit``); the host left over reads disk-homed states ahead (``widen_read_ahead``);
    where gradients are updated away as they come (``update_modes.transient``) and all of them do not fit,
    backward waits for updates to free their chunks (``bounds_grads``: ``Resolved.grads`` is "bounded");
    and what the plan holds per tier, as the runtime holds it, is counted (the device pool maps that).
    A resolved plan resolves to itself: the planner resolves every plan it simulates, and setup resolves
    the plan it is given, so the plan that runs is the plan that was simulated. The pool's device budget
    is the budget less what the plan keeps beside the pool (``Plan.beside_pool``), the host's less its
    offloaded activations (``Plan.stash``)."""
    if not (plan.beside_pool or plan.stash):
        return _resolve(plan, sizes, budgets, page, train, needs_all_grads)
    kept = f"{format_bytes(plan.beside_pool)} of device and {format_bytes(plan.stash)} of host for activations"
    if plan.beside_pool > budgets.device or plan.stash > budgets.host:
        raise PlanDoesNotFit(f"plan {plan.name!r} keeps {kept}, more than the budgets (device "
                             f"{format_bytes(budgets.device)}, host {format_bytes(budgets.host)})")
    pools = dataclasses.replace(budgets, device=budgets.device - plan.beside_pool, host=budgets.host - plan.stash)
    try:
        return _resolve(plan, sizes, pools, page, train, needs_all_grads)
    except PlanDoesNotFit as exc:
        raise PlanDoesNotFit(f"{exc} (these budgets are the pools': the plan keeps {kept})") from None


def _resolve(plan: Plan, sizes: "Sizes | Sequence[int]", budgets: Budgets, page: int, train: bool,
             needs_all_grads: bool) -> Plan:
    transient_grads = transient(plan.update, needs_all_grads)
    if train:
        plan = _reduce_where_it_fits(sizes, plan, page, budgets, "transient" if transient_grads else "all")
        plan = pieces_to_fit(sizes, plan, page, budgets, "transient" if transient_grads else "all")
    check_fits(sizes, plan, budgets, page, train, transient_grads)
    if train:
        plan = widen_read_ahead(sizes, plan, page, budgets, transient_grads)
    bounded = train and bounds_grads(sizes, plan, page, budgets, transient_grads)
    grads = "bounded" if bounded else "transient" if transient_grads and train else "all"
    need = tier_bytes(sizes, plan, page, train, "transient" if bounded else "all")
    held = sizes_of(sizes).experts
    return dataclasses.replace(plan, resolved=Resolved(grads, page, need[Tier.DEVICE], need[Tier.HOST],
                                                       need[Tier.DISK], held))


def _reduce_where_it_fits(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, budgets: Budgets,
                          grads: str) -> Plan:
    """Data parallel reduces each micro-batch's gradients where backward made them, on the device; where
    the device cannot hold the two blocks' stages that takes (a wide embedding's fp32 gradients twice, under
    a small device budget) but can without them, they are staged in host memory and reduced over the CPU
    group instead (the device-to-host traffic is then the whole block's, not the shard's)."""
    if plan.parallel.dp == 1 or plan.reduce_on == "host":
        return plan
    if tier_bytes(sizes, plan, page, grads=grads)[Tier.DEVICE] <= budgets.device:
        return plan
    on_host = dataclasses.replace(plan, reduce_on="host")
    return on_host if tier_bytes(sizes, on_host, page, grads=grads)[Tier.DEVICE] <= budgets.device else plan


def check_device_room(sizes: "Sizes | Sequence[int]", plan: Plan, page: int, mapped: int, bounded: bool) -> None:
    """A device pool maps what its run's plan counts (or its whole budget where the run replans after its
    first step): a new plan must fit what it maps."""
    need = tier_bytes(sizes, plan, page, True, "transient" if bounded else "all")[Tier.DEVICE]
    if need > mapped:
        raise PlanDoesNotFit(f"plan {plan.name!r} needs {format_bytes(need)} of device and this run's device pool "
                             f"maps {format_bytes(mapped)}: setup reserved what its own plan counts; a run that "
                             "replans must be planned from its own first step (plan 'auto' without profile_step: "
                             "its pool keeps the whole budget)")


def peak_fits(peak: int, budget: int) -> bool:
    """Whether a simulated peak (activations counted) stays within a tier's budget."""
    return peak <= budget


@dataclass(frozen=True)
class MachineRoom:
    """What this machine can give the tiers now, measured (``memory.capacity``)."""

    host: int                   # host bytes this process may still take
    freed: int = 0              # host bytes setup frees as it builds (the model's own weights in RAM)
    device_is_host: bool = True  # no accelerator: the device tier is host memory too
    device_free: int = 0        # an accelerator's free memory
    device_name: str = ""
    disk_free: int | None = None  # free space of the disk directory's filesystem
    note: str = ""              # what limits the host (the memory cgroup), for the message


def check_machine(budgets: Budgets, room: MachineRoom) -> None:
    """Refuse budgets the machine cannot hold, before anything is reserved: a budget is a promise the
    pools keep, and one the machine cannot keep would end in an mmap error, the kernel's OOM killer or a
    full disk mid-run. Without an accelerator device and host budgets share the host's room. The model's
    own weights in RAM count as room: setup frees each block's as it moves into the pools."""
    host_need = budgets.host + (budgets.device if room.device_is_host else 0)
    have = room.host + room.freed
    if host_need > have:
        what = "device + host budgets" if room.device_is_host else "host budget"
        freed = f", counting the {format_bytes(room.freed)} of model weights setup frees" if room.freed else ""
        raise BeyondMachine(f"the {what} ({format_bytes(host_need)}) exceed the memory this process can take "
                            f"({format_bytes(have)} available now{room.note}{freed}); lower --host-memory"
                            + (" / --device-memory" if room.device_is_host else ""))
    if not room.device_is_host and budgets.device > room.device_free:
        raise BeyondMachine(f"the device budget ({format_bytes(budgets.device)}) exceeds the free memory of "
                            f"{room.device_name} ({format_bytes(room.device_free)}); lower --device-memory")
    if budgets.disk and room.disk_free is not None and budgets.disk > room.disk_free:
        raise BeyondMachine(f"the disk budget ({format_bytes(budgets.disk)}) exceeds the free space under "
                            f"{budgets.disk_dir} ({format_bytes(room.disk_free)}); lower the size in --disk DIR:SIZE "
                            "or free space there")


def weights_beyond(weights: int, budgets: Budgets, device_is_host: bool, cgroup_room: int | None) -> str | None:
    """Why a model of ``weights`` fp32 bytes cannot be built in memory for a tiered run (it is then built
    on the meta device and drawn block by block), or None where it can: beyond the host budget, or, with
    the budgets setup reserves while the model still lives, beyond its memory cgroup's limit (a cap, fixed
    for the run: free memory, which varies, never picks how weights are drawn)."""
    reserved = budgets.host + (budgets.device if device_is_host else 0)
    if weights > budgets.host:
        return f"exceed the host budget ({format_bytes(budgets.host)})"
    if cgroup_room is not None and weights + reserved > cgroup_room:
        return (f"beside the budgets ({format_bytes(reserved)}) exceed this process's memory cgroup limit "
                f"({format_bytes(cgroup_room)} left under it)")
    return None


def capacity_params(budgets: Budgets) -> int:
    """The capacity bound: (device + host + disk) / 16 bytes per parameter (mixed-precision AdamW:
    16-bit params and gradients 2 + 2, fp32 master and two moments 12; BENCHMARKS.md)."""
    return (budgets.device + budgets.host + budgets.disk) // 16


def within_capacity(params: int, budgets: Budgets) -> bool:
    """Whether a model of ``params`` parameters is within the capacity bound (none beyond it can fit)."""
    return params <= capacity_params(budgets)


def check_device_cap(cap: int, budgets: Budgets) -> None:
    """A cap on the device's allocator below the device budget cannot hold what the plan counts in it."""
    if cap < budgets.device:
        raise ConfigError(f"the device cap ({format_bytes(cap)}) is below the device budget "
                          f"({format_bytes(budgets.device)}): tiertrain's device pool and the activations beside it "
                          "are planned within its budget; give a cap at or above it (the default leaves 1GiB beyond it)")
