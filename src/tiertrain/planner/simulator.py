"""One training step of a plan, replayed on a timeline per resource (DESIGN: simulator).

Each task (a copy, a compute, an update) starts when its inputs are ready, its trigger
has fired and its resource is free, and holds that resource for bytes/bandwidth or the
profiled seconds. Resources: compute, h2d, d2h, disk_read, disk_write, cpu (the AdamW
workers), net (a rank's collectives, with the profile's ``network``: the plan's ranks). Memory per tier is tracked over the same time. The result names the step time,
the per-tier peaks and the bottleneck (the busiest resource).

Approximations, stated so a mismatch can be traced: the embeddings and head are one
compute task at each end of forward and backward; the update workers are one lane at
the measured AdamW rate; across steps, ``overlap`` and ``lockfree`` hide updates behind
the next step's compute as far as the busiest resource allows. Over several ranks the
timeline is one rank's (all alike): a sharded block's fetch is its shard's copy then its
all-gather on the net, prefetched as a fetch is; its gradients' reduction runs on the net under
the next block's backward, which waits for it when it ends (one reduction in flight, as the
runtime keeps); a resident sharded block's update ends with an
all-gather of its new params; each rank updates its own share of the states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tiertrain.plan.tiers import Tier
from tiertrain.plan import Plan
from tiertrain.plan.bytes import (F32_BYTES, bounded_grads, bounds_grads, disk_passes_per_step, disk_states,
                                  grad_copies, grad_tier, in_pieces, master_home, pages, separate_param_home, sharded,
                                  tier_bytes, updated_away)
from tiertrain.planner.costs import GRAD_BYTES, grads_out_s, publishes_over_link
from tiertrain.planner.network import Network
from tiertrain.planner.profile import MachineProfile, Profile

RESOURCES = ("compute", "h2d", "d2h", "disk_read", "disk_write", "cpu", "net")


def _network(plan: Plan, p: Profile) -> Network:
    """The profile's collective rates over the plan's ranks."""
    return dataclasses.replace(p.network, dp=plan.parallel.dp)


def _own(plan: Plan, bp, numel: int) -> int:
    """Elements of a block's states one rank holds and updates."""
    return -(-numel // plan.parallel.dp) if sharded(bp, plan) else numel


@dataclass
class Timeline:
    free: dict[str, float] = field(default_factory=lambda: {r: 0.0 for r in RESOURCES})
    tasks: list[tuple[str, float, float, str]] = field(default_factory=list)   # resource, start, end, label

    def run(self, resource: str, ready: float, seconds: float, label: str) -> tuple[float, float]:
        start = max(ready, self.free[resource])
        end = start + seconds
        self.free[resource] = end
        if seconds > 0:
            self.tasks.append((resource, start, end, label))
        return start, end

    def busy(self, resource: str) -> float:
        return sum(e - s for r, s, e, _ in self.tasks if r == resource)


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
    numels = [b.params for b in (*p.blocks, p.rest)]
    need = tier_bytes(numels, plan, p.page, grads="none", bound=False)
    copies = grad_copies(plan.update, plan.max_staleness)
    if copies > 1:  # lockfree: the chunk a lagging update loop still applies, beside the one this step fills
        grads = tier_bytes(numels, plan, p.page, grads="all", bound=False)
        need = {t: v + (grads[t] - need[t]) // copies * (copies - 1) for t, v in need.items()}
    return {t.value: v for t, v in need.items()}


def simulate(plan: Plan, p: Profile, needs_all_grads: bool = False, budgets: dict[Tier, int] | None = None) -> Simulation:
    """Replay one step of ``plan`` on ``p``. ``needs_all_grads``: clipping or fp16 makes overlapped
    updates wait for the end of backward. ``budgets``: where the runtime will bound the gradients
    (``plan.bytes.bounds_grads``), those the updates take away count at most what it lets live (the
    time backward then waits for an update to free one is not modelled)."""
    m, tl = p.machine, Timeline()
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

    slots = plan.window + plan.cache
    n = len(p.blocks)
    acts = int(p.acts_on_device)    # on CPU, activations are outside the device tier's pool
    _, rest_end = tl.run("compute", 0.0, p.rest.forward_s / 2, "embed")
    starts, ends = [], []
    last_done = rest_end
    for k, (b, bp) in enumerate(zip(p.blocks, plan.blocks)):
        ready = last_done
        if bp.stream:
            trigger = starts[k - plan.prefetch] if plan.prefetch and k >= plan.prefetch else last_done
            slot_free = ends[k - slots] if k >= slots else 0.0
            _, ready = _fetch(tl, plan, bp, p, max(trigger, slot_free), b.params * p.compute_bytes, f"fetch {b.name}")
            ready = max(ready, last_done)
        s, e = tl.run("compute", ready, b.forward_s, f"fwd {b.name}")
        starts.append(s)
        ends.append(e)
        last_done = e
        saved = b.hidden_bytes if bp.recompute else b.act_bytes
        change(e, "device", saved * acts)
        if bp.offload_hidden:
            _, off = tl.run("d2h", e, saved / m.d2h_bps, f"stash {b.name}")
            change(off, "device", -saved * acts)
            change(off, "host", saved)
    _, last_done = tl.run("compute", last_done, p.rest.forward_s / 2 + p.rest.backward_s / 2, "head")
    grads_done, bstarts, bends = {}, [], []
    order = list(range(n - 1, -1, -1))
    streamed = [i for i in range(n) if plan.blocks[i].stream]
    resident_after_forward = set(streamed[-slots:]) if streamed else set()  # still in their slots
    landed = [0.0]  # reductions' ends, in backward order: each is waited for when the next block's backward ends
    for j, i in enumerate(order):
        b, bp = p.blocks[i], plan.blocks[i]
        ready = last_done = max(last_done, landed[-2] if len(landed) > 1 else 0.0)
        saved = b.hidden_bytes if bp.recompute else b.act_bytes
        params_in = b.params * p.compute_bytes if bp.stream and i not in resident_after_forward else 0
        if params_in or bp.offload_hidden:
            trigger = bstarts[j - plan.prefetch] if plan.prefetch and j >= plan.prefetch else last_done
            slot_free = bends[j - slots] if j >= slots else 0.0
            arrived = max(trigger, slot_free)
            if params_in:
                arrived = _fetch(tl, plan, bp, p, arrived, params_in, f"fetch {b.name} (bwd)")[1]
            if bp.offload_hidden:
                arrived = tl.run("h2d", arrived, saved / m.h2d_bps, f"unstash {b.name}")[1]
            ready = max(ready, arrived)
            if bp.offload_hidden:
                change(arrived, "host", -saved)
                change(arrived, "device", saved * acts)
        work = b.backward_s + (b.recompute_seconds if bp.recompute else 0.0)
        s, e = tl.run("compute", ready, work, f"bwd {b.name}")
        bstarts.append(s)
        bends.append(e)
        change(e, "device", -saved * acts)
        landed.append(_reduce(tl, plan, bp, p, e, b.params, b.name))
        _, grads_done[i] = tl.run("d2h", landed[-1], grads_out_s(b, bp.home is Tier.DEVICE, m), f"grads {b.name}")
        change(grads_done[i], grad_tier(bp).value, pages(_own(plan, bp, b.params) * GRAD_BYTES, p.page, bound=False),
               updated_away(bp))
    _, device_end = tl.run("compute", max(last_done, landed[-2] if len(landed) > 1 else 0.0), p.rest.backward_s / 2,
                           "embed bwd")
    device_end = max(_reduce(tl, plan, plan.rest, p, device_end, p.rest.params, "rest"), landed[-1])
    change(device_end, grad_tier(plan.rest).value,
           pages(_own(plan, plan.rest, p.rest.params) * GRAD_BYTES, p.page, bound=False), updated_away(plan.rest))
    _updates(plan, p, tl, grads_done, bstarts, order, device_end, needs_all_grads, change)
    step = _step_time(plan, tl, device_end, needs_all_grads, m)
    peaks = {t: max(v for _, tier, v in curve if tier == t) for t in ("device", "host", "disk")}
    peaks["device"] += max(b.act_bytes for b in p.blocks) * acts   # one block's activations while it computes
    bottleneck = max(RESOURCES, key=tl.busy)
    return Simulation(step, peaks, bottleneck, tl, curve)


def _grad_caps(plan: Plan, p: Profile, budgets: dict[Tier, int] | None) -> dict[str, int]:
    """Per tier, the most updated-away gradient bytes the runtime lets live, where it bounds them."""
    numels = [b.params for b in (*p.blocks, p.rest)]
    if budgets is None or not bounds_grads(numels, plan, p.page, budgets, p.transient_grads):
        return {}
    return {t.value: v for t, v in bounded_grads(numels, plan, p.page, bound=False).items()}


def _fetch(tl: Timeline, plan: Plan, bp, p: Profile, ready: float, nbytes: int, label: str) -> tuple[float, float]:
    """A streamed block's params into its slot: from the host, or read from disk when its fp32
    master on disk is its only copy (no separate param home); a sharded block's own share so,
    then all-gathered from the others'."""
    own = _own(plan, bp, nbytes)
    if master_home(bp) is Tier.DISK and not separate_param_home(bp, plan):
        start, end = tl.run("disk_read", ready, own / p.machine.disk_read_bps, label)
    else:
        start, end = tl.run("h2d", ready, own / p.machine.h2d_bps, label)
    if sharded(bp, plan):
        end = tl.run("net", end, _network(plan, p).gather_s(nbytes), f"gather {label}")[1]
    return start, end


def _reduce(tl: Timeline, plan: Plan, bp, p: Profile, ready: float, numel: int, name: str) -> float:
    """A block's gradients reduced over the ranks from when its backward ends; when it lands."""
    seconds = _network(plan, p).reduce_s(numel * GRAD_BYTES, sharded(bp, plan))
    return tl.run("net", ready, seconds, f"reduce {name}")[1] if seconds else ready


def _updates(plan, p, tl, grads_done, bstarts, order, device_end, needs_all_grads, change) -> None:
    """Each block's update, in backward order; a task that runs once every N steps holds its
    resource for 1/N of its time (the step's share of it)."""
    m = p.machine
    for j, i in enumerate(order):
        b, bp = p.blocks[i], plan.blocks[i]
        own = _own(plan, bp, b.params)
        share = disk_passes_per_step(plan.update, plan.max_staleness) if bp.home is Tier.DISK else 1.0
        ready = grads_done[i] if plan.update != "sync" and not needs_all_grads else device_end
        read = 0.0
        if bp.home is Tier.DISK:
            ready, read = _read_states(tl, bp, m, ready, bstarts[j], share * own, f"read {b.name}")
        if bp.home is Tier.DEVICE and not m.device_is_host:
            done = ready  # updated on the GPU, next to nothing beside its compute (as costs has it)
        else:
            done = max(read, tl.run("cpu", ready, share * own / m.adam_params_per_s, f"adam {b.name}")[1])
        change(done, grad_tier(bp).value, -pages(own * GRAD_BYTES, p.page, bound=False), updated_away(bp))
        if publishes_over_link(bp.stream, bp.home is Tier.DEVICE, m, p.compute_bytes):
            tl.run("h2d", done, share * own * p.compute_bytes / m.h2d_bps, f"publish {b.name}")
        if sharded(bp, plan) and not bp.stream:  # the new params of every rank's share into the slot
            tl.run("net", done, share * _network(plan, p).gather_s(b.params * p.compute_bytes), f"gather {b.name}")
        if bp.home is Tier.DISK:
            tl.run("disk_write", done, share * own * _disk_bytes(bp) / m.disk_write_bps, f"write {b.name}")
    ready = device_end if plan.update == "sync" or needs_all_grads else 0.0
    rest_disk = plan.rest.home is Tier.DISK
    share = disk_passes_per_step(plan.update, plan.max_staleness) if rest_disk else 1.0
    own = _own(plan, plan.rest, p.rest.params)
    read = 0.0
    if rest_disk:  # the embeddings' and head's states are read in and written back like a block's
        ready, read = _read_states(tl, plan.rest, m, ready, 0.0, share * own, "read rest")
    done = max(read, tl.run("cpu", ready, share * own / m.adam_params_per_s, "adam rest")[1])
    if sharded(plan.rest, plan):
        tl.run("net", done, _network(plan, p).gather_s(p.rest.params * p.compute_bytes), "gather rest")
    if rest_disk:
        tl.run("disk_write", done, share * own * _disk_bytes(plan.rest) / m.disk_write_bps, "write rest")
    change(max(done, device_end), grad_tier(plan.rest).value, -pages(own * GRAD_BYTES, p.page, bound=False),
           updated_away(plan.rest))


def _read_states(tl: Timeline, bp, m, ready: float, ahead: float, numel: float, label: str) -> tuple[float, float]:
    """A disk-homed block's states read for its update: (when its AdamW may start, when the reads end).
    Read ahead from ``ahead`` and the update after them; or, updated in pieces, read as the update
    starts and the update a piece behind its reads (``runtime.pieces``)."""
    seconds = numel * _disk_bytes(bp) / m.disk_read_bps
    if not in_pieces(bp):
        return max(ready, tl.run("disk_read", ahead, seconds, label)[1]), 0.0
    start, end = tl.run("disk_read", ready, seconds, label)
    first = min(seconds, disk_states(bp) * bp.piece / m.disk_read_bps)
    return start + first, end


def _disk_bytes(bp) -> int:
    """Bytes per parameter a disk-homed block's update reads and writes back: its fp32 states on disk."""
    return disk_states(bp) * F32_BYTES


def _step_time(plan: Plan, tl: Timeline, device_end: float, needs_all_grads: bool, m: MachineProfile) -> float:
    """Sync: the step ends with its last update. Otherwise updates hide behind the next step's
    compute as far as the busiest resource allows; reads and writes share one disk. On a
    CPU-only machine compute, copies (memcpy) and AdamW run on the same cores, and so does the
    disk tier's share (syscalls, checksums: the probe's CPU seconds per byte), so that work adds
    up instead of overlapping."""
    last = max(e for _, _, e, _ in tl.tasks)
    disk = tl.busy("disk_read") + tl.busy("disk_write")
    shared = 0.0
    if m.device_is_host:
        disk_bytes = tl.busy("disk_read") * m.disk_read_bps + tl.busy("disk_write") * m.disk_write_bps
        shared = sum(tl.busy(r) for r in ("compute", "h2d", "d2h", "cpu")) + disk_bytes * m.disk_cpu_s_per_byte
    if plan.update == "sync":
        return max(last, shared)
    bound = max(max(tl.busy(r) for r in RESOURCES), disk)
    return max(device_end, bound, shared, last - device_end if needs_all_grads else 0.0)
