"""From solver answers to a runtime Plan, and the choice among them by simulated step time."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tiertrain.errors import UserError
from tiertrain.plan.tiers import Tier
from tiertrain.plan import DEFAULT_MAX_STALENESS, BlockPlan, ParallelLayout, Plan
from tiertrain.plan.fit import (MAX_PIECE, TRANSIENT_HINT, PlanDoesNotFit, Sizes, cut_in_pieces, grads_held, host_masters,
                                peak_fits, resolve)
from tiertrain.plan.fit import fits as plan_fits
from tiertrain.plan.update_modes import disk_passes_per_step, grad_copies, lags_one_step, rules, transient
from tiertrain.planner.costs import activation_bytes, stash_bytes
from tiertrain.planner.profile import Profile
from tiertrain.planner.simulator import Simulation, simulate
from tiertrain.planner.solvers import SOLVERS, Problem, Solution, dynamic_programming, feasible
from tiertrain.planner.streams import GAIN, measured_counts, with_streams
from tiertrain.units import format_bytes


def lifetime_prefetch(p: Profile, window: int) -> int:
    """ANGEL-PTM's trigger point: issue a block's copy as many accesses ahead as its copy takes
    computes to hide, within the slots the window leaves free."""
    if window < 2:
        return 0
    b = max(p.blocks, key=lambda b: b.params)
    ahead = math.ceil(b.params * p.compute_bytes / p.machine.h2d_bps / max(b.forward_s, 1e-12))
    return max(1, min(window - 1, ahead))


def to_plan(s: Solution, p: Profile, update: str = "overlap", max_staleness: int = DEFAULT_MAX_STALENESS) -> Plan:
    """The runtime plan of a solution; over several ranks laid out for them, every block sharded or
    every block replicated as the profile's network says."""
    net = p.network
    shard = net.parallel and net.shard
    blocks = tuple(BlockPlan(home=Tier.DEVICE if c.device_home else Tier.DISK if disk else Tier.HOST,
                             stream=c.stream, recompute=c.recompute, offload_hidden=c.offload_hidden, shard=shard,
                             piece=p.piece if disk else 0)
                   for c, disk in zip(s.choices, s.disk_home))
    streams = any(c.stream for c in s.choices)
    rest_disk = len(s.disk_home) > len(s.choices) and s.disk_home[-1]
    how = f"hybrid {net.dp // net.split}x{net.split}" if net.hybrid else "sharded" if net.shard else "replicated"
    layout = f"/{how} x{net.dp}" if net.parallel else ""
    return Plan(blocks, BlockPlan(home=Tier.DISK if rest_disk else Tier.HOST, shard=shard,
                                  piece=p.piece if rest_disk else 0),
                window=s.window if streams else 1, prefetch=lifetime_prefetch(p, s.window) if streams else 0,
                update=update, name=f"auto/{s.solver}{layout}", compute_dtype=p.compute_dtype,
                max_staleness=max_staleness, fixed_lag=p.fixed_lag, read_ahead=p.read_ahead,
                update_workers=p.update_workers,
                parallel=ParallelLayout(dp=net.dp, ep=net.ep, shard_group=net.split if net.hybrid else 0))


def run_profile(p: Profile, update: str, max_staleness: int, needs_all_grads: bool, group: bool = False) -> Profile:
    """The profile with what the run's update mode makes the runtime hold: gradient chunks per block,
    disk passes per step, whether gradients are updated away as backward flushes them, and (``group``: a
    tensor-parallel group's ranks, which run a lockfree loop at max staleness 1 at a fixed lag,
    ``api.tensor_parallel.lag_in_group``) the compute copies a fixed lag keeps. ``plan auto`` and
    ``tiertrain plan`` both plan through this, so they choose the same plan for one run."""
    lagged = group and lags_one_step(update, max_staleness)
    return dataclasses.replace(p, grad_copies=grad_copies(update, max_staleness),
                               disk_passes=disk_passes_per_step(update, max_staleness),
                               transient_grads=transient(update, needs_all_grads), master_moves=rules(update).loops,
                               fixed_lag=lagged, piece=0 if lagged else p.piece)


@dataclass(frozen=True)
class Candidate:
    solver: str
    plan: Plan | None
    sim: Simulation | None


def candidates(pb: Problem, update: str = "overlap", solvers: tuple[str, ...] = tuple(SOLVERS),
               needs_all_grads: bool = False, max_staleness: int = DEFAULT_MAX_STALENESS) -> list[Candidate]:
    """Each solver's plan and its simulation (None where the solver found nothing that fits).
    Lockfree plans need the profile's ``grad_copies`` set for ``max_staleness``."""
    out = []
    for name in solvers:
        s = SOLVERS[name](pb)
        if s is None:
            out.append(Candidate(name, None, None))
            continue
        widened = _widened(to_plan(s, pb.profile, update, max_staleness), pb, needs_all_grads)
        out.append(Candidate(name, *widened) if widened is not None else Candidate(name, None, None))
    return out


def _widened(plan: Plan, pb: Problem, needs_all_grads: bool) -> tuple[Plan, Simulation] | None:
    """The plan with the host it leaves spent, and its device left as cache (``size_cache``): on
    reading ahead alone (``widen_read_ahead``); on disk-homed blocks' masters first
    (``host_masters``), within the gradients' count, so backward waits where it did before and no
    more; or, where gradients may be updated away as they come, with every host-homed block sent to
    disk and the host spent on masters first (the solvers keep whole blocks on the host, which spares
    32 B of disk traffic a parameter for 12 B of host, where a master spares 16 B for 4 B). Whichever
    the simulator predicts fastest. Measured on a 354M GPT at 3000 MiB of host (2-core VM, alternated):
    every master on the host 3.59 and 3.84 s a step, the solvers' 8 host-homed blocks 4.88 and 5.19 s."""
    p = pb.profile
    sizes = profile_sizes(p)
    bases = [plan]
    for pipeline in _pipelines(plan, sizes, p.page):
        bases.append(_masters_first(sizes, pipeline, pb))
        if p.transient_grads:
            bases.append(host_masters(sizes, _host_homes_to_disk(pipeline, sizes), p.page, pb.budgets, "transient"))
    found: list[tuple[Plan, Simulation]] = []
    for base in dict.fromkeys(bases):
        if base is not plan and not _fits(sizes, base, pb):
            continue
        wide = resolved(base, pb, needs_all_grads)  # the plan as the run will run it: what is simulated
        if wide is not None:
            found.append(size_cache(wide, simulate(wide, p, needs_all_grads), pb, needs_all_grads))
    if not found:
        return None
    # the budget check counts no activations, the simulator does: a variant that leaves the device less
    # room for them than the budget (pieces keep their gradients there) is kept out, unless the
    # solver's own plan (found[0]) already needs as much
    room = max(pb.device, found[0][1].peaks["device"])
    chosen = min((f for f in found if peak_fits(f[1].peaks["device"], room)), key=lambda f: f[1].step_s)
    return over_streams(chosen, pb, needs_all_grads, room)


def over_streams(chosen: tuple[Plan, Simulation], pb: Problem, needs_all_grads: bool,
                 room: int) -> tuple[Plan, Simulation]:
    """The plan with its blocks over the stream count the profile measured fastest (``planner.streams``),
    where the simulator replays it at least ``GAIN`` faster than one stream within the same device room, and
    its updates run in the step's thread (sync); else the plan as it was."""
    plan, sim = chosen
    if rules(plan.update).updates_as_final:  # a worker's update would not wait for the streams (``UpdateMode.check``)
        return chosen
    for n in measured_counts(pb.profile):
        wide = resolved(with_streams(chosen[0], n), pb, needs_all_grads)
        if wide is None:
            continue
        tried = simulate(wide, pb.profile, needs_all_grads)
        if peak_fits(tried.peaks["device"], room) and tried.step_s < (1 - GAIN) * chosen[1].step_s \
                and tried.step_s < sim.step_s:
            plan, sim = wide, tried
    return plan, sim


def profile_sizes(p: Profile) -> Sizes:
    """What a profile's blocks hold, as ``plan.fit`` counts it."""
    return p.sizes()


def resolved(plan: Plan, pb: Problem, needs_all_grads: bool) -> Plan | None:
    """``plan.fit.resolve`` of the plan under the problem's budgets, its device budget less what the
    compute holds beside the pool (``costs.activation_bytes``): the run's pool maps what the plan counts,
    and activations come on top of it. None where it does not fit."""
    plan = dataclasses.replace(plan, beside_pool=activation_bytes(plan, pb.profile), stash=stash_bytes(plan, pb.profile))
    try:
        return resolve(plan, profile_sizes(pb.profile), pb.budgets, pb.profile.page, needs_all_grads=needs_all_grads)
    except PlanDoesNotFit:
        return None


def _pipelines(plan: Plan, sizes: Sizes, page: int) -> list[Plan]:
    """The plan's own update pipeline and, where it uses a disk, the lean one (one worker, one block
    read ahead): it stages 3 blocks' states in host, not 6, so the host holds more masters and the
    disk moves fewer bytes, but each update waits for the one before it. Measured on a 354M GPT at 2
    GiB of host (2-core VM, alternated): 12 masters and the lean pipeline 5.08 and 5.18 s a step, 2
    masters and the default one 5.91 and 5.96 s. Then both with their disk-homed blocks updated in
    pieces (``PIECES_TRIED``): a worker stages a few pieces, not whole blocks, so the host holds more
    masters again, but no piece is read ahead during forward. Measured on the same 354M at 2 GiB
    (2-core VM, one run each, alternated): 4 MiB pieces and 21 masters read 2.77 and wrote 2.57 GB a
    step against 3.58 and 3.02 for 12 masters whole, 4.44 and 3.95 s a step against 4.57 s. The
    simulator models every pipeline's waits (``planner.updates``) and chooses."""
    lean = dataclasses.replace(plan, read_ahead=1, update_workers=1)
    whole = [plan, lean] if plan.uses_disk and lean != plan else [plan]
    if not plan.uses_disk or any(b.piece for b in (*plan.blocks, plan.rest)):
        return whole  # a plan in pieces already (a fallback's) keeps its own
    pieces = dict.fromkeys(max(page, piece // page * page) for piece in PIECES_TRIED)
    return whole + [cut_in_pieces(sizes, w, piece) for w in whole for piece in pieces]


def _masters_first(sizes: Sizes, plan: Plan, pb: Problem) -> Plan:
    """``host_masters`` within the gradients the plan's pipeline holds."""
    p = pb.profile
    return host_masters(sizes, plan, p.page, pb.budgets, grads_held(sizes, plan, p.page, pb.budgets,
                                                                     p.transient_grads))


def _fits(sizes: Sizes, plan: Plan, pb: Problem) -> bool:
    """Whether a plan fits the budgets with the gradients counted as the runtime will hold them."""
    page = pb.profile.page
    return plan_fits(sizes, plan, pb.budgets, page, grads=grads_held(sizes, plan, page, pb.budgets,
                                                                 pb.profile.transient_grads))


def _host_homes_to_disk(plan: Plan, sizes: Sizes) -> Plan:
    """The plan with every host-homed block's states on disk (where a disk is used at all), updated in
    the plan's pieces where it has them."""
    if not plan.uses_disk:
        return plan

    def moved(bp: BlockPlan) -> BlockPlan:
        return dataclasses.replace(bp, home=Tier.DISK) if bp.home is Tier.HOST else bp
    on_disk = dataclasses.replace(plan, blocks=tuple(moved(b) for b in plan.blocks), rest=moved(plan.rest))
    piece = max((b.piece for b in (*plan.blocks, plan.rest)), default=0)
    return cut_in_pieces(sizes, on_disk, piece) if piece else on_disk


def size_cache(plan: Plan, sim: Simulation, pb: Problem, needs_all_grads: bool = False) -> tuple[Plan, Simulation]:
    """Elixir's cache sizing: the device memory a plan leaves unused becomes cache slots, as many as
    fit (the runtime's count, whole pages and the bound, and the simulated peak with activations),
    so the blocks forward used last are still in place when backward starts instead of fetched
    again. Kept only where the simulator predicts it no slower."""
    spare = sum(b.stream for b in plan.blocks) - plan.window - plan.cache
    for k in range(plan.cache + spare, plan.cache, -1):
        bigger = resolved(dataclasses.replace(plan, cache=k), pb, needs_all_grads)  # device-homed grads too
        if bigger is None:
            continue
        cached = simulate(bigger, pb.profile, needs_all_grads)
        if peak_fits(cached.peaks["device"], pb.device) and cached.step_s <= sim.step_s:
            return bigger, cached
    return plan, sim


def best(cands: list[Candidate]) -> Candidate | None:
    found = [c for c in cands if c.sim is not None]
    return min(found, key=lambda c: c.sim.step_s) if found else None


class NoPlanFits(UserError):
    """No solver found a plan within the budgets."""


def choose(pb: Problem, solvers: tuple[str, ...] = tuple(SOLVERS), update: str = "overlap",
           needs_all_grads: bool = False,
           max_staleness: int = DEFAULT_MAX_STALENESS) -> tuple[Candidate, list[Candidate]]:
    """The best predicted plan and every solver's candidate; NoPlanFits, with the smallest device
    budget that would work, when none fits."""
    for tried in [pb, *_fallbacks(pb)]:
        cands = candidates(tried, update, solvers, needs_all_grads, max_staleness)
        chosen = best(cands)
        if chosen is not None:
            return chosen, cands
    raise NoPlanFits(f"no plan fits device {format_bytes(pb.device)}, host {format_bytes(pb.host)}, disk "
                     f"{format_bytes(pb.disk)} with solvers {', '.join(solvers)}; {_smallest_hint(pb)}"
                     f"{_transient_hint(pb)}")


def choose_layout(pb: Problem, solvers: tuple[str, ...] = tuple(SOLVERS), update: str = "overlap",
                  needs_all_grads: bool = False,
                  max_staleness: int = DEFAULT_MAX_STALENESS) -> tuple[Candidate, list[Candidate]]:
    """``choose`` over the profile's ranks: each rank's budgets are ``pb``'s. Every block's states
    sharded over the ranks (ZeRO-2 where a block stays on the device, ZeRO-3 where it streams) hold
    1/dp of them per rank but send 3 (N-1)/N x its compute bytes a step for streamed blocks;
    replicated (DDP) sends 2 (N-1)/N x its gradients' and holds them whole. Both are planned, with
    the devices' spare memory as cache (Elixir's C_SIZE), and the faster that fits is chosen. Over
    several nodes also hybrid: sharded inside each node (1/node_ranks per rank), replicated across,
    whose only traffic between nodes is the shards' all-reduces (``Network.layouts``)."""
    net = pb.profile.network
    if not net.parallel:
        return choose(pb, solvers, update, needs_all_grads, max_staleness)
    found, refused = [], None
    for each in net.layouts():
        layout = dataclasses.replace(pb, profile=dataclasses.replace(pb.profile, network=each))
        try:
            found.append(choose(layout, solvers, update, needs_all_grads, max_staleness))
        except NoPlanFits as exc:
            refused = refused or exc
    if not found:
        raise refused
    chosen = min((c for c, _ in found), key=lambda c: c.sim.step_s)
    cands = [c for _, cands in found for c in cands]
    mixed = per_block_layout(chosen, pb, needs_all_grads)
    return (mixed, [*cands, mixed]) if mixed is not chosen else (chosen, cands)


def per_block_layout(chosen: Candidate, pb: Problem, needs_all_grads: bool) -> Candidate:
    """The chosen plan with each block's layout chosen for it: one pass over the blocks, each switched
    between sharded and replicated where the plan still fits and the simulator predicts a faster step
    (a block replicated sends no gathers; one sharded updates 1/N of its states and holds 1/N of them:
    which pays differs with the block's size, home and streaming)."""
    plan, sim = chosen.plan, chosen.sim
    switched = 0
    for i in range(len(plan.blocks) + 1):
        bp = plan.rest if i == len(plan.blocks) else plan.blocks[i]
        flipped = dataclasses.replace(bp, shard=not bp.shard)
        other = (dataclasses.replace(plan, rest=flipped) if i == len(plan.blocks) else
                 dataclasses.replace(plan, blocks=(*plan.blocks[:i], flipped, *plan.blocks[i + 1:])))
        other = resolved(other, pb, needs_all_grads)
        if other is None:
            continue
        trial = simulate(other, pb.profile, needs_all_grads)
        if peak_fits(trial.peaks["device"], pb.device) and trial.step_s < sim.step_s:
            plan, sim, switched = other, trial, switched + 1
    if not switched:
        return chosen
    named = dataclasses.replace(plan, name=f"{chosen.plan.name}+{switched} switched")
    return Candidate(chosen.solver, named, sim)


def _fallbacks(pb: Problem) -> list[Problem]:
    """What ``choose`` tries, in order, when no plan fits ``pb``: a host too small for the default
    disk pipeline gets one worker and one block read ahead (each disk-homed block's update then
    overlaps less, but the run fits where it did not); one too small even for that, disk-homed
    blocks updated through it in pieces (``runtime.pieces``), the largest piece first, with the default
    pipeline and then the lean one."""
    p = pb.profile
    lean = dataclasses.replace(p, read_ahead=1, update_workers=1)
    profiles = [lean] if lean != p else []
    if not p.piece and pb.disk and not p.fixed_lag:  # (a fixed lag's update holds a block's master whole)
        for pipeline in dict.fromkeys((p, lean)):  # the default pipeline's pieces first, largest first
            profiles += [dataclasses.replace(pipeline, piece=max(piece, p.page)) for piece in PIECES_TRIED]
    return [dataclasses.replace(pb, profile=q) for q in profiles]


PIECES_TRIED = (MAX_PIECE, MAX_PIECE // 4, MAX_PIECE // 16, MAX_PIECE // 64)


def solvable(pb: Problem, update: str, needs_all_grads: bool, max_staleness: int = DEFAULT_MAX_STALENESS) -> bool:
    """Whether the DP's plan, resolved and simulated as ``choose`` takes it, fits ``pb`` or one of the
    fallbacks ``choose`` tries: its answer without the other solvers' cost."""
    return any(best(candidates(tried, update, ("dp",), needs_all_grads, max_staleness)) is not None
               for tried in [pb, *_fallbacks(pb)])


def fits(pb: Problem) -> bool:
    """Whether any plan fits the budgets: the DP finds one wherever one exists (within its device
    discretisation), with the default disk pipeline or the fallbacks ``choose`` tries. No
    simulation and no hints: what ``--max-model`` asks of each candidate model."""
    lean = dataclasses.replace(pb.profile, read_ahead=1, update_workers=1)
    frugal = [lean] + ([dataclasses.replace(lean, piece=max(PIECES_TRIED[-1], lean.page))]
                       if pb.disk and not pb.profile.piece and not pb.profile.fixed_lag else [])
    return feasible(pb) or any(feasible(dataclasses.replace(pb, profile=f)) for f in frugal if f != pb.profile)


def _smallest_hint(pb: Problem) -> str:
    """The smallest budgets that would work: more device alone if that does it, else more host
    (at this device budget, then at the smallest device that pairs with it)."""
    device = _smallest(pb, "device")
    if device is not None:
        return f"a device budget of {format_bytes(device, up=True)} would (with this host and disk)"
    host = _smallest(pb, "host")
    if host is not None:
        return f"a host budget of {format_bytes(host, up=True)} would (with this device and disk)"
    roomy = pb.with_budgets(device=_LIMIT)
    host = _smallest(roomy, "host")
    if host is None:
        return "no budgets up to 1 TiB each would with this disk; give a disk (--disk DIR:SIZE) or a larger one"
    device = _smallest(pb.with_budgets(host=host), "device")
    return (f"the smallest budgets that would: device {format_bytes(device or _LIMIT, up=True)} and host "
            f"{format_bytes(host, up=True)} (with this disk)")


_LIMIT = 1 << 40


def _smallest(pb: Problem, tier: str) -> int | None:
    """The smallest budget of ``tier`` ("device" or "host"), to 1%, for which the DP finds a plan,
    keeping the others; None if even 1 TiB fails."""
    def fits(nbytes: int) -> bool:
        return dynamic_programming(pb.with_budgets(**{tier: nbytes})) is not None

    lo, hi = getattr(pb, tier), _LIMIT
    if lo >= hi or not fits(hi):
        return None
    while hi - lo > max(lo // 100, 1 << 20):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _transient_hint(pb: Problem) -> str:
    """Where the run counts every gradient on the host and a run that updates them away would fit, say how."""
    if pb.profile.transient_grads:
        return ""
    away = dataclasses.replace(pb, profile=run_profile(pb.profile, "overlap", DEFAULT_MAX_STALENESS,
                                                       needs_all_grads=False))
    if any(dynamic_programming(tried) for tried in [away, *_fallbacks(away)]):  # as choose falls back
        return f"; or plan for a run where {TRANSIENT_HINT}"
    return ""
