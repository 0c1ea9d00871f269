"""What a plan holds in each tier, from its chunks' sizes alone.

One accounting used on both sides of the plan: the runtime refuses a plan that does
not fit before it allocates anything (``runtime.budget_check``), and the planner's
simulator starts its memory curves from the same figures (``planner.simulator``), so a
plan the planner predicts to fit is a plan the runtime accepts. Chunks are allocated in
whole pages, plus one page because a chunk may start inside a page another one shares.
Imports nothing from the runtime or the planner.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tiertrain.plan.plan import BlockPlan, Plan
from tiertrain.plan.tiers import Tier
from tiertrain.precisions import BYTES

F32_BYTES = 4
# what makes a run's gradients "transient", in the words of the flags, for refusals to suggest
TRANSIENT_HINT = ("each block's gradients are updated away as backward makes them, so the host holds a few, "
                  "not all: --update overlap --grad-clip 0 (no clipping, no gradient accumulation)")


def pages(nbytes: int, page: int, bound: bool = True) -> int:
    """Bytes a chunk of ``nbytes`` occupies in a pool of ``page``-byte pages (0: unpaged). The
    bound adds the page a chunk may share with the one before it; without it, the likely figure
    (a chunk's share of a shared page is as often zero as not)."""
    if page <= 0:
        return nbytes
    return -(-nbytes // page) * page + (page if bound else 0)


MIN_PAGE = 4096     # the O_DIRECT alignment: no page is smaller
MAX_PAGE_WASTE = 0.10


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


def sharded(bp: BlockPlan, plan: Plan) -> bool:
    """Whether a block's states and gradients are split over data-parallel ranks."""
    return bp.shard and plan.parallel.dp > 1


def separate_param_home(bp: BlockPlan, plan: Plan, train: bool = True) -> bool:
    """Whether a streamed (or sharded) block keeps its compute params in a host chunk of their own;
    else its fp32 master is what its device slot is filled (gathered) from, wherever the master lives
    (disk too). A master that travels between disk and host is no source for a lockfree forward (an
    update may have it in flight), nor for ``param_copy``'s; one kept on the host is, as a
    host-homed block's is."""
    return (not train or plan.compute_dtype != "fp32"
            or (master_home(bp) is Tier.DISK and (bp.param_copy or plan.update == "lockfree")))


def master_in_slot(bp: BlockPlan, plan: Plan, train: bool = True) -> bool:
    """Whether a block's fp32 master *is* its device slot: a resident fp32 block whose states live
    on the device is updated in place, as plain PyTorch updates its parameters, instead of keeping
    a second fp32 copy and copying it into the slot after every update."""
    return (train and not bp.stream and bp.home is Tier.DEVICE and plan.compute_dtype == "fp32"
            and not sharded(bp, plan))


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


PIECE_BUFFERS = 3  # per update worker: the piece being read, the one being updated, the one being written


def piece_bytes(nbytes: int, bp: BlockPlan) -> int:
    """Bytes of one state piece of a block whose states are ``nbytes`` each (never more than them)."""
    return min(nbytes, bp.piece)


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


def transient(update: str, needs_all_grads: bool) -> bool:
    """Whether a run updates each block's gradients away as backward makes them, so the host need not
    hold them all: overlap, when no step needs every gradient first (``RunOptions.needs_all_grads``).
    The one rule setup, the budget check and the planner apply."""
    return update == "overlap" and not needs_all_grads


def grad_copies(update: str, max_staleness: int) -> int:
    """Gradient chunks a block may hold at once. Lockfree with staleness allowed: the chunk the
    block's update loop took and is applying, and the one backward fills meanwhile (steps add into
    it until the loop takes it). Elsewhere one: at staleness 0 the next forward waits for the
    update, and the other modes update between backward and the next step's gradients."""
    return 2 if update == "lockfree" and max_staleness > 0 else 1


def steps_per_disk_pass(update: str, max_staleness: int) -> int:
    """Steps of gradients a disk-homed block's update pass takes: one, except in lockfree mode,
    where its loop waits for ``max_staleness`` steps of them (each pass costs the states' disk
    traffic whatever it carries), so its disk traffic, AdamW and publish come once every that many
    steps. The runtime passes so; the simulator and the solvers charge each step that share."""
    return max(1, max_staleness) if update == "lockfree" else 1


def disk_passes_per_step(update: str, max_staleness: int) -> float:
    """A disk-homed block's update passes per step (``steps_per_disk_pass``, inverted)."""
    return 1 / steps_per_disk_pass(update, max_staleness)


def bounded_grads(numels: Sequence[int], plan: Plan, page: int, bound: bool = True) -> dict[Tier, int]:
    """Per tier, the gradient bytes a run that bounds its gradients (``bounds_grads``) holds at most of
    the blocks whose updates take them away (``updated_away``): ``alive_grad_bytes`` of their chunks."""
    plans = list(plan.blocks) + [plan.rest]
    dp = plan.parallel.dp
    out: dict[Tier, int] = {}
    for tier in (Tier.HOST, Tier.DEVICE):
        away = [(n * F32_BYTES, p) for n, p in zip(numels, plans) if updated_away(p) and grad_tier(p) is tier]
        if away:
            own = [-(-f // dp) if sharded(p, plan) else f for f, p in away]
            out[tier] = alive_grad_bytes(own, [f for f, _ in away], plan.update_workers, dp, page, bound)
    return out


def grad_floors(own: Sequence[int], whole: Sequence[int], dp: int) -> tuple[int, int, int]:
    """The layout of one tier's bounded grad chunks (``own``: this rank's bytes of each, ``whole``: each
    block's before reduction): (the size a chunk takes, a whole block's sum, the size kept at the pool's
    far end). Chunks of mixed sizes (a wide embedding's beside the blocks') fragment a pool until a
    contiguous one no longer fits a budget that holds its bytes: so in one process the largest size
    goes to the far end of the pool and every other chunk is as large as the largest of the others;
    over several ranks every chunk is as large as the largest, beside the largest whole block being
    reduced. The runtime lays them out so (``Runtime.wire``), ``alive_grad_bytes`` counts them so."""
    top = max(own)
    if dp > 1:
        return top, max(whole), 0
    return max((n for n in own if n < top), default=0), 0, top


def alive_grad_bytes(own: Sequence[int], whole: Sequence[int], workers: int, dp: int, page: int,
                     bound: bool = True) -> int:
    """What ``workers + 1`` bounded grad chunks take at most, laid out as ``grad_floors`` says: in one
    process a slot at the far end for each chunk of the largest size that may be alive, the others each
    as large as the largest of them; over several ranks that many of the largest, and the whole sum."""
    alive = workers + 1
    mine, summed, top = grad_floors(own, whole, dp)
    if dp > 1:
        return alive * pages(mine, page, bound) + pages(summed, page, bound)
    rest = sum(1 for n in own if n < top)
    return min(alive, len(own) - rest) * pages(top, page, bound) + min(alive, rest) * pages(mine, page, bound)


def has_own_place(own: int, others: Sequence[int]) -> bool:
    """Whether, in one process, ``alive_grad_bytes`` lays out a chunk of ``own`` bytes in a place no chunk
    of ``others`` (the other bounded chunks of its tier) can take: its size is the largest and no other
    has it, or it is the only one smaller than the largest."""
    top = max([*others, own])
    return own not in others if own == top else all(o == top for o in others)


def tier_bytes(numels: Sequence[int], plan: Plan, page: int, train: bool = True, grads: str = "all",
               bound: bool = True) -> dict[Tier, int]:
    """Bytes per tier for blocks of ``numels`` elements (the repeated blocks, then the rest).

    ``grads``: ``all`` holds every block's gradient chunks (``grad_tier``, ``grad_copies``);
    ``transient`` holds only one host chunk per update worker plus the one backward fills (overlap
    without clipping or accumulation updates each block's gradients away at once), and
    device-homed blocks' chunks in full; ``none`` leaves gradients out (the simulator adds them on
    its timeline).
    """
    if len(numels) != len(plan.blocks) + 1:
        raise ValueError(f"{len(numels)} chunk sizes for a plan of {len(plan.blocks)} blocks + rest")
    plans = list(plan.blocks) + [plan.rest]
    dp = plan.parallel.dp
    full = [n * F32_BYTES for n in numels]                         # a rank's own gradients before they are reduced
    sizes = [-(-f // dp) if sharded(p, plan) else f for f, p in zip(full, plans)]  # master, moments, grads: fp32
    compute = [n * BYTES[plan.compute_dtype] for n in numels]          # slots
    homes = [-(-c // dp) if sharded(p, plan) else c for c, p in zip(compute, plans)]  # param homes

    def chunk(nbytes: int) -> int:
        return pages(nbytes, page, bound)

    need = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    copies = grad_copies(plan.update, plan.max_staleness)
    streamed = [c for c, p in zip(compute, plans) if p.stream]
    if streamed:
        need[Tier.DEVICE] += min(plan.window + plan.cache, len(streamed)) * chunk(max(streamed))
    for size, csize, home, f, bp in zip(sizes, compute, homes, full, plans):
        if not bp.stream and not master_in_slot(bp, plan, train):
            need[Tier.DEVICE] += chunk(csize)
        if (bp.stream or sharded(bp, plan)) and separate_param_home(bp, plan, train):
            need[Tier.HOST] += chunk(home)
        if train:
            if grads == "all" or (grads == "transient" and not updated_away(bp)):
                need[grad_tier(bp)] += copies * chunk(size)
                if dp > 1:
                    need[grad_tier(bp)] += chunk(f)  # this rank's gradients, summed over micro-batches, until reduced
            for tier in state_homes(bp):      # master (the slot, where master_in_slot), exp_avg, exp_avg_sq
                need[tier] += chunk(size)
    if not train:
        return need
    if grads == "transient":
        for tier, nbytes in bounded_grads(numels, plan, page, bound).items():
            need[tier] += nbytes
    on_disk = sorted((disk_states(p) * chunk(s) for s, p in zip(sizes, plans)
                      if p.home is Tier.DISK and not in_pieces(p)), reverse=True)
    # states in host for updates: read ahead, being updated, being written back (one per worker)
    held = plan.read_ahead + 2 * plan.update_workers
    need[Tier.HOST] += sum(on_disk[:held])
    need[Tier.HOST] += staging_bytes(sizes, plans, plan.update_workers, page, bound)
    return need


def fits_budgets(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int], grads: str = "all") -> bool:
    """Whether ``plan`` fits every budget, its gradients counted as ``grads`` says (``tier_bytes``)."""
    need = tier_bytes(numels, plan, page, grads=grads)
    return all(need[t] <= budgets[t] for t in need)


MAX_PIECE = 64 << 20  # the largest piece tried: a few large reads in flight per state, a few buffers per worker


def pieces_to_fit(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int], grads: str = "all") -> Plan:
    """Where the host cannot hold the states of the blocks whose updates it holds at once, the plan
    with its larger disk-homed blocks updated in pieces (``in_pieces``): the largest piece, halving
    from ``MAX_PIECE`` in whole pages, with which the plan fits every budget (the pieces' gradients
    wait on the device). A plan whose host fits, or that names its pieces already, is returned as it
    is, and so is one no piece size makes fit (the budget check then says what it needs)."""
    fits_host = tier_bytes(numels, plan, page, grads=grads)[Tier.HOST] <= budgets[Tier.HOST]
    if fits_host or not plan.uses_disk or any(b.piece for b in (*plan.blocks, plan.rest)):
        return plan
    piece = max(page, MAX_PIECE // page * page)
    while True:
        pieced = cut_in_pieces(numels, plan, piece)
        if fits_budgets(numels, pieced, page, budgets, grads):
            return pieced
        if piece <= page:
            return plan
        piece = max(page, piece // 2 // page * page)


def cut_in_pieces(numels: Sequence[int], plan: Plan, piece: int) -> Plan:
    """The plan with each disk-homed block whose states are larger than ``piece`` bytes updated in
    pieces of that size (``in_pieces``)."""
    def cut(bp: BlockPlan, n: int) -> BlockPlan:
        big = bp.home is Tier.DISK and n * F32_BYTES > piece
        return dataclasses.replace(bp, piece=piece) if big else bp
    return dataclasses.replace(plan, blocks=tuple(cut(b, n) for b, n in zip(plan.blocks, numels)),
                               rest=cut(plan.rest, numels[-1]))


def widest_read_ahead(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int],
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
        if not fits_budgets(numels, wider, page, budgets, grads):
            break
        best = wider
    return best


def host_masters(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int], grads: str = "all") -> Plan:
    """The plan with the host it leaves spent where that spares the most disk traffic per byte: first
    disk-homed blocks' masters on the host (``host_master``: 4 B a parameter spare the update's 4 B
    read and 4 B write of it, and for a streamed fp32 block both 4 B reads of its compute params),
    those sparing most first, the largest first; then, with host to spare, their whole states (8 B
    more spare the moments' 16 B). Each is kept where the plan still fits. Host-homed blocks stay
    (the planner tries them on disk as a plan of its own, ``planner.auto._widened``): sending one to
    disk frees its states but stages them for its update."""
    plans = list((*plan.blocks, plan.rest))

    def with_(trial: list[BlockPlan]) -> Plan:
        return dataclasses.replace(plan, blocks=tuple(trial[:-1]), rest=trial[-1])

    def spares(i: int) -> int:
        return 16 if plans[i].stream and not separate_param_home(plans[i], plan) else 8

    def kept(i: int, **change) -> None:
        nonlocal plans
        trial = plans[:i] + [dataclasses.replace(plans[i], **change)] + plans[i + 1:]
        if fits_budgets(numels, with_(trial), page, budgets, grads):
            plans = trial

    on_disk = [i for i, bp in enumerate(plans) if bp.home is Tier.DISK]
    for i in sorted(on_disk, key=lambda i: (-spares(i), -numels[i])):
        kept(i, host_master=True)
    for i in sorted((i for i in on_disk if plans[i].host_master), key=lambda i: numels[i]):
        kept(i, home=Tier.HOST, host_master=False, piece=0)
    return with_(plans)


def bounds_grads(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int], transient: bool) -> bool:
    """Whether backward must wait for updates to free gradient chunks: the run updates gradients away
    as they come (``transient``: overlap, no clipping, no accumulation) and the budgets cannot hold
    them all. Only then does the runtime bound them; elsewhere it never makes backward wait."""
    return transient and not fits_budgets(numels, plan, page, budgets)


def widen_read_ahead(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int],
                     transient: bool) -> Plan:
    """``widest_read_ahead`` with the gradients counted as the runtime will hold them: all of them,
    unless they do not all fit (``bounds_grads``). The planner applies it to each plan before
    simulating it, and setup to a plan it was given, so the plan that runs is the simulated one."""
    return widest_read_ahead(numels, plan, page, budgets, grads_held(numels, plan, page, budgets, transient))


def grads_held(numels: Sequence[int], plan: Plan, page: int, budgets: dict[Tier, int], transient: bool) -> str:
    """How ``tier_bytes`` counts the gradients the runtime will hold under ``plan``: ``transient`` where
    it bounds them (``bounds_grads``), else ``all``."""
    return "transient" if bounds_grads(numels, plan, page, budgets, transient) else "all"
