"""One training step of a plan, replayed on a timeline per resource (DESIGN: simulator).

Each task (a copy, a compute, an update) starts when its inputs are ready, its trigger
has fired and its resource is free (``planner.timeline``), and holds that resource for
bytes/bandwidth or the profiled seconds. Resources: compute, h2d, d2h, disk_read and
disk_write (one disk: they take turns, unless the disk tier lets them go at once and the
disk is faster so: ``MachineProfile.disk_lanes``), cpu (the AdamW workers), net (a rank's collectives,
with the profile's ``network``: the plan's ranks). Updates run in the runtime's pipeline
(``planner.updates``: its workers, the blocks it reads ahead, backward's wait for room for
gradients). Memory per tier is tracked over the same time. The result names the step time,
the per-tier peaks and the bottleneck (the busiest resource).

Approximations, stated so a mismatch can be traced: the embeddings and head are one
compute task at each end of forward and backward; AdamW is one lane at the measured rate,
whichever worker runs it; across steps, ``overlap`` and ``lockfree`` hide updates behind
the next step's compute as far as the busiest resource allows, and ``overlap`` as far as
the next forward's wait for the updates it needs allows. Over several ranks the
timeline is one rank's (all alike): a sharded block's fetch is its shard's copy then its
all-gather on the net, prefetched as a fetch is; its gradients' reduction runs on the net under
the next block's backward, which waits for it when it ends (one reduction in flight, as the
runtime keeps); a resident sharded block's update ends with an
all-gather of its new params; each rank updates its own share of the states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from tiertrain.plan.tiers import Tier
from tiertrain.plan import Budgets, Plan
from tiertrain.plan.bytes import grad_tier, pages, sharded, updated_away
from tiertrain.plan.fit import bounded_grads, bounds_grads, tier_bytes
from tiertrain.plan.update_modes import grad_copies, rules, updates_during_backward
from tiertrain.planner.costs import GRAD_BYTES, grads_out_s, more_micro_batches, working_bytes
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.planner.streams import at_streams
from tiertrain.planner.timeline import RESOURCES, Timeline
from tiertrain.planner.updates import UpdatePipeline, fills_slot_from_disk, network, own, own_of

__all__ = ["RESOURCES", "Simulation", "Timeline", "simulate"]


@dataclass
class Simulation:
    step_s: float
    peaks: dict[str, int]                       # tier -> bytes
    bottleneck: str
    timeline: Timeline
    memory: list[tuple[float, str, int]]        # (time, tier, bytes in use from then on)


def _fixed_memory(plan: Plan, p: Profile) -> dict[str, int]:
    """What the plan holds throughout the step (plan_bytes, as the runtime counts it); gradients,
    stashes and activations come and go on the timeline."""
    numels = p.sizes()
    need = tier_bytes(numels, plan, p.page, grads="none", bound=False)
    copies = grad_copies(plan.update, plan.max_staleness)
    if copies > 1:  # lockfree: the chunk a lagging update loop still applies, beside the one this step fills
        grads = tier_bytes(numels, plan, p.page, grads="all", bound=False)
        need = {t: v + (grads[t] - need[t]) // copies * (copies - 1) for t, v in need.items()}
    return {t.value: v for t, v in need.items()}


def simulate(plan: Plan, p: Profile, needs_all_grads: bool = False, budgets: Budgets | None = None) -> Simulation:
    """Replay one step of ``plan`` on ``p``. ``needs_all_grads``: clipping or fp16 makes overlapped
    updates wait for the end of backward. Where the runtime will bound the gradients (the resolved
    plan's decision; for a plan not resolved yet, ``plan.fit.bounds_grads`` under ``budgets``), those
    the updates take away count at most what it lets live, and backward waits for an update to free
    one (``UpdatePipeline.room_for_grads``).

    Where the disk goes faster reading and writing at once (``MachineProfile.disk_lanes``), the step
    is replayed both ways and the faster taken: on two lanes each direction runs at its shared rate
    even where the other is idle (a sync step's reads, then its writes), and taking turns at the
    rates alone is what such a step gets. Blocks run over several streams at their measured times
    (``planner.streams``)."""
    p = at_streams(p, plan)
    turns = _replay_step(plan, p, needs_all_grads, budgets, Timeline())
    lanes = p.machine.disk_lanes()
    if lanes is None:
        return turns
    side = _replay_step(plan, dataclasses.replace(p, machine=lanes), needs_all_grads, budgets,
                        Timeline(shared_disk=False))
    return side if side.step_s <= turns.step_s else turns


def _replay_step(plan: Plan, p: Profile, needs_all_grads: bool, budgets: dict[Tier, int] | None,
                 tl: Timeline) -> Simulation:
    m = p.machine
    mem = _fixed_memory(plan, p)
    curve: list[tuple[float, str, int]] = [(0.0, t, v) for t, v in mem.items()]
    live = dict(mem)
    caps = _grad_caps(plan, p, budgets)
    away_live = {t: 0 for t in caps}

    def change(t: float, tier: str, delta: int, away: bool = False) -> None:
        if away and tier in caps:  # what the bound lets live of the updated-away gradients
            before = min(away_live[tier], caps[tier])
            away_live[tier] += delta
            delta = min(away_live[tier], caps[tier]) - before
        live[tier] += delta
        curve.append((t, tier, live[tier]))

    during = updates_during_backward(plan.update, needs_all_grads)  # each block updated as its gradients are in
    pipe = UpdatePipeline.of(plan, p, tl, change, bounded=bool(caps), follows_backward=during)
    replay = _Replay(plan, p, tl, pipe, change)
    needed, last_done = replay.forward()
    device_end = replay.backward(last_done, during)
    n = len(p.blocks)
    for i in [n] if during else [n, *range(n)]:  # the rest's gradients come last; all at once: forward order
        pipe.update(i, device_end)
    mode = rules(plan.update)  # the next forward waits for the updates it needs, where they follow backward
    chain = pipe.chain(needed) if mode.updates_as_final and not mode.loops else 0.0
    step = _step_time(plan, tl, device_end, needs_all_grads, m, chain)
    peaks = {t: max(v for _, tier, v in curve if tier == t) for t in ("device", "host", "disk")}
    # one block's activations while it computes, a gradient autograd made, and the logits the rest saves
    peaks["device"] += working_bytes(p) + p.rest.act_bytes
    for tier, more in more_micro_batches(plan, p).items():  # a pipeline stage's other micro-batches in flight
        peaks[tier] += more
    bottleneck = max(RESOURCES, key=tl.busy)
    return Simulation(step, peaks, bottleneck, tl, curve)


@dataclass
class _Replay:
    """One step's forward and backward on the timeline, the updates handed to ``pipe`` as backward
    frees each block's gradients."""
    plan: Plan
    p: Profile
    tl: Timeline
    pipe: UpdatePipeline
    change: Callable[..., None]

    @property
    def slots(self) -> int:
        return self.plan.window + self.plan.cache

    def forward(self) -> tuple[dict[int, float], float]:
        """(when the step needs each block's params final, the next step waiting for their updates;
        when forward and the head end)."""
        plan, p, tl, m, change = self.plan, self.p, self.tl, self.p.machine, self.change
        _, rest_end = tl.run("compute", 0.0, p.rest.forward_s / 2, "embed")
        starts, ends = [], []
        needed = {len(p.blocks): 0.0}
        last_done = rest_end
        for k, (b, bp) in enumerate(zip(p.blocks, plan.blocks)):
            ready = last_done
            if bp.stream:
                trigger = starts[k - plan.prefetch] if plan.prefetch and k >= plan.prefetch else last_done
                slot_free = ends[k - self.slots] if k >= self.slots else 0.0
                needed[k] = max(trigger, slot_free)
                _, ready = _fetch(tl, plan, bp, p, needed[k], b.shared * p.compute_bytes, f"fetch {b.name}")
                ready = max(ready, last_done)
            if k == 0:
                self.pipe.forward_reads(rest_end)
            s, e = tl.run("compute", ready, b.forward_s, f"fwd {b.name}")
            needed.setdefault(k, s)
            starts.append(s)
            ends.append(e)
            last_done = e
            saved = b.hidden_bytes if bp.recompute else b.act_bytes
            change(e, "device", saved)
            if bp.offload_hidden:
                _, off = tl.run("d2h", e, saved * p.micro_batches / m.d2h_bps, f"stash {b.name}")
                change(off, "device", -saved)
                change(off, "host", saved)
        return needed, tl.run("compute", last_done, p.rest.forward_s / 2 + p.rest.backward_s / 2, "head")[1]

    def backward(self, last_done: float, during: bool) -> float:
        """Backward from ``last_done``, each block updated as its gradients are in where ``during``;
        when the device's part of the step ends (the embeddings' backward and the rest's reduction)."""
        plan, p, tl, m, change, pipe = self.plan, self.p, self.tl, self.p.machine, self.change, self.pipe
        n, slots = len(p.blocks), self.slots
        bstarts, bends = [], []
        streamed = [i for i in range(n) if plan.blocks[i].stream]
        resident_after_forward = set(streamed[-slots:]) if streamed else set()  # still in their slots
        landed = [0.0]  # reductions' ends, in backward order: each is waited for when the next block's backward ends
        for j, i in enumerate(range(n - 1, -1, -1)):
            b, bp = p.blocks[i], plan.blocks[i]
            ready = last_done = max(last_done, landed[-2] if len(landed) > 1 else 0.0)
            saved = b.hidden_bytes if bp.recompute else b.act_bytes
            params_in = b.shared * p.compute_bytes if bp.stream and i not in resident_after_forward else 0
            filled = last_done   # its slot's fill landed (``backward_begins`` reads its states ahead then)
            if params_in or bp.offload_hidden:
                trigger = bstarts[j - plan.prefetch] if plan.prefetch and j >= plan.prefetch else last_done
                arrived = max(trigger, bends[j - slots] if j >= slots else 0.0)
                if params_in:
                    arrived = filled = max(last_done, _fetch(tl, plan, bp, p, arrived, params_in, f"fetch {b.name} (bwd)")[1])
                if bp.offload_hidden:
                    arrived = tl.run("h2d", arrived, saved * p.micro_batches / m.h2d_bps, f"unstash {b.name}")[1]
                    change(arrived, "host", -saved)
                    change(arrived, "device", saved)
                ready = max(ready, arrived)
            pipe.read(i, filled, from_slot=fills_slot_from_disk(bp, plan) and not sharded(bp, plan))
            work = b.backward_s + (b.recompute_seconds if bp.recompute else 0.0)
            s, e = tl.run("compute", ready, work, f"bwd {b.name}")
            bstarts.append(s)
            bends.append(e)
            change(e, "device", -saved)
            landed.append(_reduce(tl, plan, bp, p, e, b))
            room = pipe.room_for_grads() if pipe.bounded and updated_away(bp) else 0.0  # backward waits for it
            last_done = max(e, room)
            _, grads = tl.run("d2h", max(landed[-1], room), grads_out_s(b, bp.home is Tier.DEVICE, m),
                              f"grads {b.name}")
            change(grads, grad_tier(bp).value, pages(own_of(plan, bp, b) * GRAD_BYTES, p.page, bound=False),
                   updated_away(bp))
            if during:
                pipe.update(i, grads)
        _, end = tl.run("compute", max(last_done, landed[-2] if len(landed) > 1 else 0.0), p.rest.backward_s / 2,
                        "embed bwd")
        end = max(_reduce(tl, plan, plan.rest, p, end, p.rest), landed[-1])
        change(end, grad_tier(plan.rest).value,
               pages(own_of(plan, plan.rest, p.rest) * GRAD_BYTES, p.page, bound=False), updated_away(plan.rest))
        return end


def _grad_caps(plan: Plan, p: Profile, budgets: Budgets | None) -> dict[str, int]:
    """Per tier, the most updated-away gradient bytes the runtime lets live, where it bounds them: as the
    resolved plan says (``plan.fit.resolve``), or, for a plan not resolved yet, under ``budgets``."""
    numels = p.sizes()
    if plan.resolved is not None:
        bounded = plan.resolved.bounded
    else:
        bounded = budgets is not None and bounds_grads(numels, plan, p.page, budgets, p.transient_grads)
    if not bounded:
        return {}
    return {t.value: v for t, v in bounded_grads(numels, plan, p.page, bound=False).items()}


def _fetch(tl: Timeline, plan: Plan, bp, p: Profile, ready: float, nbytes: int, label: str) -> tuple[float, float]:
    """A streamed block's params into its slot: from the host, or read from disk when its fp32
    master on disk is its only copy (no separate param home); a sharded block's own share so,
    then all-gathered from the others'."""
    share = own(plan, bp, nbytes)
    if fills_slot_from_disk(bp, plan):
        start, end = tl.run("disk_read", ready, share / p.machine.disk_read_bps, label)
    else:
        start, end = tl.run("h2d", ready, share / p.machine.h2d_bps, label)
    if sharded(bp, plan):
        end = tl.run("net", end, network(plan, p).gather_s(nbytes), f"gather {label}")[1]
    return start, end


def _reduce(tl: Timeline, plan: Plan, bp, p: Profile, ready: float, b: BlockProfile) -> float:
    """A block's gradients reduced over the ranks from when its backward ends (its held experts' over
    their replicas); when it lands."""
    net = network(plan, p)
    seconds = net.reduce_s(b.shared * GRAD_BYTES, sharded(bp, plan)) + net.experts_reduce_s(b.experts * GRAD_BYTES)
    return tl.run("net", ready, seconds, f"reduce {b.name}")[1] if seconds else ready


def _step_time(plan: Plan, tl: Timeline, device_end: float, needs_all_grads: bool, m: MachineProfile,
               chain: float) -> float:
    """Sync: the step ends with its last update. Otherwise updates hide behind the next step's
    compute as far as the busiest resource allows and the next forward's wait for them (``chain``,
    ``UpdatePipeline.chain``) lets; reads and writes share one disk (or take a lane each). On a
    CPU-only machine compute, copies (memcpy) and AdamW run on the same cores, and so does the
    disk tier's share (syscalls, checksums: the probe's CPU seconds per byte), so that work adds
    up instead of overlapping."""
    last = max(e for _, _, e, _ in tl.tasks)
    disk = tl.busy("disk_read") + tl.busy("disk_write") if tl.shared_disk else 0.0  # else: each lane's own
    shared = 0.0
    if m.device_is_host:
        moved = tl.busy("disk_read") * m.disk_read_bps + tl.busy("disk_write") * m.disk_write_bps
        shared = sum(tl.busy(r) for r in ("compute", "h2d", "d2h", "cpu")) + moved * m.disk_cpu_s_per_byte
    if rules(plan.update).waits_at_step:
        return max(last, shared)
    bound = max(max(tl.busy(r) for r in RESOURCES), disk)
    return max(device_end, bound, shared, chain, last - device_end if needs_all_grads else 0.0)
