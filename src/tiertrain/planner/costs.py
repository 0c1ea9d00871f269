"""The per-block cost model the solvers search over (H3T §3.3: a layer's time and memory
under each setting of its switches, added up over layers).

A block's *choice* sets its switches: stream its params or keep them resident, recompute
or keep activations, offload the hidden state to the host, and home its optimizer states
on the device or the host (the host's overflow goes to disk afterwards, ``homes``). Its
cost is (device bytes, seconds): forward and backward each as long as the slowest of their
compute and their copies, the backward no shorter than the block's CPU update it hides
(STRONGHOLD's concurrent optimizer). The simulator then times whole plans more faithfully.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tiertrain.plan import Plan
from tiertrain.plan.bytes import pages, reduce_staging, reductions_in_flight
from tiertrain.plan.fit import alive_grad_bytes, piece_buffer_bytes
from tiertrain.planner.network import Network
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile

STATE_BYTES = 12      # fp32 master + exp_avg + exp_avg_sq per parameter
GRAD_BYTES = 4        # fp32 gradients accumulate on the host
SWITCH_S = 1e-6       # what a switch costs beyond the model (hooks, allocations): breaks ties towards fewer


@dataclass(frozen=True)
class Choice:
    stream: bool
    recompute: bool
    offload_hidden: bool
    device_home: bool


CHOICES: tuple[Choice, ...] = tuple(Choice(*bits) for bits in itertools.product((False, True), repeat=4))


def choices_for(p: Profile) -> tuple[Choice, ...]:
    """The switches worth planning on the profile's machine: on a CPU-only one the device is the host's
    RAM, so a stash of activations (``offload_hidden``) copies them within it and frees nothing."""
    return tuple(c for c in CHOICES if not (c.offload_hidden and p.machine.device_is_host))


def saved_bytes(b: BlockProfile, c: Choice) -> int:
    """What the block keeps for backward between its forward and its backward."""
    return saved_bytes_of(b, c.recompute)


def device_bytes(p: Profile, b: BlockProfile, c: Choice) -> int:
    """A block's own device bytes, in whole pages, and its saved activations unless they wait on the
    host: the device budget holds the compute's memory, pool and activations, on a CPU-only machine
    too (there the device is the host's RAM, and a process holds its budgets and an overhead, no more).
    A device-homed block keeps its gradients there too (``plan_bytes.grad_tier``), and a resident fp32
    one's slot is its master (``plan_bytes.master_in_slot``), unless its states are sharded (the slot
    holds the whole block, the master this rank's shard) or it runs a fixed lag (the master a step ahead)."""
    slot = b.experts if c.stream else b.params  # a streamed block's held experts keep a slot of their own
    own = pages(slot * p.compute_bytes, p.page) if slot else 0
    states = _states(p, b) + _grads(p, b) if c.device_home else 0
    sharded = p.network.parallel and p.network.shard
    if c.device_home and not c.stream and p.compute_bytes == GRAD_BYTES and not sharded and not p.fixed_lag:
        own = 0
    if c.offload_hidden:  # one micro-batch's comes back ahead of its backward in a pipeline
        acts = saved_bytes(b, c) if p.stash_ahead else 0
    else:
        acts = saved_bytes(b, c) * p.micro_in_flight
    return own + states + acts


def own_numel(net: Network, b: BlockProfile) -> int:
    """Elements of a block's states one rank holds: its share of the block, and the experts it holds."""
    return net.per_rank(b.shared) + b.experts


def optimizer_s(numel: int, m: MachineProfile, disk_home: bool) -> float:
    """One update of ``numel`` parameters' states (a rank's share of a sharded block's)."""
    t = numel / m.adam_params_per_s
    if disk_home:
        t += numel * STATE_BYTES * (1 / m.disk_read_bps + 1 / m.disk_write_bps)
    return t


def publishes_over_link(stream: bool, device_home: bool, m: MachineProfile, compute_bytes: int = 4) -> bool:
    """Whether a block's update ends with a copy of its new params into its device slot: a resident
    block whose master is off the device (a streamed one is copied in at its next use anyway); on a
    CPU-only machine also a device-homed resident block's in bf16/fp16, a memcpy on the shared cores
    (in fp32 its slot is its master)."""
    return not stream and (not device_home or (m.device_is_host and compute_bytes != GRAD_BYTES))


def grads_out_s(b: BlockProfile, device_home: bool, m: MachineProfile) -> float:
    """Seconds backward spends moving a block's gradients into its grad chunk: over the link to
    the host, or nothing worth counting where they stay on the device (``plan_bytes.grad_tier``).
    On a CPU-only machine either is a memcpy on the shared cores."""
    if device_home and not m.device_is_host:
        return 0.0
    return b.params * GRAD_BYTES / m.d2h_bps


def block_seconds(b: BlockProfile, c: Choice, m: MachineProfile, compute_bytes: int, window: int,
                  disk_home: bool = False, disk_passes: float = 1.0, net: Network = Network(),
                  micro_batches: int = 1) -> float:
    """Forward plus the longer of backward and the update it hides. ``disk_passes``: a disk-homed
    block's update passes per step (lockfree passes every few steps: each step carries its share).
    Over several ranks (``net``): a streamed sharded block's fetch is its shard's copy then the
    all-gather (prefetched, as a fetch is); the gradients' reduction runs under the next block's
    backward (one in flight, as the runtime keeps); a resident sharded block's update ends with an all-gather of its
    new params; each rank updates its own share. ``micro_batches``: a pipeline stage's (``b``'s activations
    one micro-batch's, each micro-batch's stashed)."""
    numel = own_numel(net, b)
    gather = net.gather_s(b.shared * compute_bytes) if net.shard else 0.0
    fetch = net.per_rank(b.shared) * compute_bytes / m.h2d_bps + gather if c.stream else 0.0
    saved = saved_bytes(b, c) * micro_batches
    stash_out = saved / m.d2h_bps if c.offload_hidden else 0.0
    stash_in = saved / m.h2d_bps if c.offload_hidden else 0.0
    grads_out = grads_out_s(b, c.device_home, m)
    recompute = b.recompute_seconds if c.recompute else 0.0
    if window < 2 and c.stream:  # one slot: a block's copy cannot start while another computes
        fwd = b.forward_s + fetch + stash_out
        bwd = b.backward_s + recompute + fetch + stash_in + grads_out
    else:
        fwd = max(b.forward_s, fetch, stash_out)
        bwd = max(b.backward_s + recompute, fetch + stash_in, grads_out)
    reduce = net.reduce_s(b.shared * GRAD_BYTES, net.shard) + net.experts_reduce_s(b.experts * GRAD_BYTES)
    bwd = max(bwd, reduce)  # under the next block's backward
    opt = 0.0 if c.device_home and not m.device_is_host else optimizer_s(numel, m, disk_home)
    if publishes_over_link(c.stream, c.device_home, m, compute_bytes):
        opt += numel * compute_bytes / m.h2d_bps
    if not c.stream:
        opt += gather
    opt *= disk_passes if disk_home else 1.0
    return fwd + max(bwd, opt) + SWITCH_S * (c.stream + c.recompute + c.offload_hidden)


def fixed_device_bytes(p: Profile, window: int, any_stream: bool) -> int:
    """Device bytes no switch removes: the rest block and what it saves (the logits), the streaming
    slots, one block's activations in flight (a recomputed block rebuilds all of them during its
    backward), autograd's gradient of a parameter before it moves into the pools, and over several
    ranks the gradients being reduced there (``plan.bytes.reduce_staging``)."""
    biggest = pages(max(b.shared for b in p.blocks) * p.compute_bytes, p.page)  # held experts: a slot of their own
    working = working_bytes(p) + p.rest.act_bytes
    pieced = _grads_of(p, [*p.blocks, p.rest]) if p.piece else 0  # any block may go to disk: counted as if all do
    every = [*p.blocks, p.rest]
    parts = [own_numel(p.network, b) * GRAD_BYTES if p.network.shard else 0 for b in every]
    staged = reduce_staging([b.params * GRAD_BYTES for b in every], parts, p.network.dp, p.page,
                            in_flight=reductions_in_flight(p.network.hybrid))
    return (pages(p.rest.params * p.compute_bytes, p.page) + (window * biggest if any_stream else 0) + working
            + pieced + staged)


def working_bytes(p: Profile) -> int:
    """What the compute holds beside the saved activations at once: one block's activations being
    rebuilt or used, and one gradient autograd made (``Profile.grad_transient_bytes``)."""
    return max(b.act_bytes for b in p.blocks) + p.grad_transient_bytes


def activation_bytes(plan: Plan, p: Profile) -> int:
    """The most the compute holds beside the device pool in one step: every block's saved activations
    that stay on the device (recomputed ones keep their input) for each micro-batch in flight at once
    (``Profile.micro_in_flight``), the offloaded ones of the micro-batch prefetched ahead of its backward
    (``Profile.stash_ahead``), the rest's, and ``working_bytes``. A run's pool maps what its plan counts
    (``Plan.resolved``), so plan auto leaves it this much less."""
    kept = sum(saved_bytes_of(b, bp.recompute) for b, bp in zip(p.blocks, plan.blocks) if not bp.offload_hidden)
    return kept + more_micro_batches(plan, p)["device"] + p.rest.act_bytes + working_bytes(p)


def more_micro_batches(plan: Plan, p: Profile) -> dict[str, int]:
    """What the micro-batches in flight beside the one a block computes add (a pipeline stage's, by its
    schedule): on the device the saved activations kept there and one micro-batch's offloaded ones
    prefetched ahead of their backward; on the host the others' offloaded ones (none outside a pipeline)."""
    saved = [(saved_bytes_of(b, bp.recompute), bp.offload_hidden) for b, bp in zip(p.blocks, plan.blocks)]
    others = p.micro_in_flight - 1
    kept = sum(n for n, off in saved if not off) + p.rest.act_bytes  # the logits (the last stage's) too
    stashed = sum(n for n, off in saved if off)
    return {"device": others * kept + (stashed if p.stash_ahead else 0), "host": others * stashed}


def stash_bytes(plan: Plan, p: Profile) -> int:
    """Host bytes the plan's offloaded activations take at once, in whole pages (``runtime.switches``), for
    every micro-batch in flight."""
    return p.micro_in_flight * sum(pages(saved_bytes_of(b, bp.recompute), p.page)
                                   for b, bp in zip(p.blocks, plan.blocks) if bp.offload_hidden)


def saved_bytes_of(b: BlockProfile, recompute: bool) -> int:
    return b.hidden_bytes if recompute else b.act_bytes


def switch_host_bytes(p: Profile, b: BlockProfile, c: Choice) -> int:
    """Host bytes a block's switches add (its stash, its params' host copy); states are placed later."""
    stash = saved_bytes(b, c) * p.micro_in_flight if c.offload_hidden else 0
    home = (c.stream or p.network.parallel and p.network.shard) and p.compute_bytes != 4
    return stash + (pages(own_numel(p.network, b) * p.compute_bytes, p.page) if home else 0)


def _states(p: Profile, b: BlockProfile) -> int:
    """A rank's master and moments of the block (its share where they are sharded)."""
    return 3 * pages(own_numel(p.network, b) * GRAD_BYTES, p.page)


def _grads(p: Profile, b: BlockProfile) -> int:
    """A rank's gradient chunks of the block (its part: over several ranks each micro-batch's are
    reduced on the device first, ``reduce_staging``)."""
    return p.grad_copies * pages(own_numel(p.network, b) * GRAD_BYTES, p.page)


def base_host_bytes(p: Profile, disk_budget: int) -> int:
    """Host bytes no switch removes: the gradients, and whatever states (the rest block's included)
    the disk cannot take. Device-homed blocks' gradients stay off the host, but the DP's host
    dimension only adds: counting them here errs towards refusing, and ``host_bytes`` (which
    every full assignment is checked with) counts them exactly."""
    states = sum(_states(p, b) for b in (*p.blocks, p.rest))
    if p.piece:  # the blocks the disk takes update in pieces: their gradients wait on the device
        return _staging(p, [*p.blocks, p.rest]) + max(0, states - disk_budget)
    return _grads_of(p, [*p.blocks, p.rest]) + max(0, states - disk_budget)


def host_bytes(p: Profile, choices: tuple[Choice, ...], disk_home: tuple[bool, ...]) -> int:
    """Host bytes: grads of blocks not homed on the device, host-homed states, streamed params'
    host copies, stashes, and the disk-homed states the plan holds in host while it reads them
    ahead, updates them and writes them back (``plan_bytes.tier_bytes``' rule). ``disk_home`` has
    one more entry than there are blocks where the rest block's states may go to disk too."""
    rest_disk = len(disk_home) > len(p.blocks) and disk_home[-1]
    sharded = p.network.parallel and p.network.shard
    in_host = [b for b, c, d in zip(p.blocks, choices, disk_home) if not c.device_home and not (p.piece and d)]
    total = (0 if rest_disk else _states(p, p.rest)) + _grads_of(
        p, ([] if p.piece and rest_disk else [p.rest]) + in_host)
    for b, c, disk in zip(p.blocks, choices, disk_home):
        if not c.device_home and not disk:
            total += _states(p, b)
        total += switch_host_bytes(p, b, c)
        # a compute copy apart from an fp32 master: ``plan.bytes.separate_param_home``
        if (c.stream or sharded) and p.compute_bytes == 4 and (p.fixed_lag or disk and p.master_moves):
            total += pages(own_numel(p.network, b) * p.compute_bytes, p.page)
    if sharded and p.compute_bytes == 4 and (p.fixed_lag or rest_disk and p.master_moves):  # the rest's too
        total += pages(own_numel(p.network, p.rest) * p.compute_bytes, p.page)
    disk_blocks = [b for b, d in zip(p.blocks, disk_home) if d] + ([p.rest] if rest_disk else [])
    if p.piece:  # a few pieces per worker, not whole blocks' states
        return total + _staging(p, disk_blocks)
    on_disk = [_states(p, b) for b in disk_blocks]
    return total + sum(sorted(on_disk, reverse=True)[: p.read_ahead + 2 * p.update_workers])


def _staging(p: Profile, blocks: list[BlockProfile]) -> int:
    """Host bytes of the piecewise updates' buffers (``plan.bytes.staging_bytes``' rule)."""
    largest = max((min(p.piece, own_numel(p.network, b) * GRAD_BYTES) for b in blocks), default=0)
    return piece_buffer_bytes(largest, p.update_workers, p.page)


def _grads_of(p: Profile, blocks: list[BlockProfile]) -> int:
    """The gradient chunks of ``blocks`` a run holds at once (in host, or on the device for blocks
    updated in pieces): every block's, or, when they are updated away as backward flushes them
    (``transient_grads``), one per optimizer worker plus the one backward is filling, as the runtime
    lays them out (``plan.bytes.alive_grad_bytes``)."""
    if not p.transient_grads:
        return sum(_grads(p, b) for b in blocks)
    if not blocks:
        return 0
    own = [own_numel(p.network, b) * GRAD_BYTES for b in blocks]
    return alive_grad_bytes(own, p.update_workers, p.network.dp, p.page)


def homes(p: Profile, choices: tuple[Choice, ...], host_budget: int, disk_budget: int) -> tuple[bool, ...] | None:
    """Which host-homed blocks send their states to disk so the host fits (first blocks first:
    every block costs the same disk I/O), and last, where even that is not enough, the rest block's
    (embeddings and head: with a wide vocabulary its states outweigh several blocks'). One entry per
    block, then the rest's. None when even that does not fit host and disk."""
    disk = [False] * (len(choices) + 1)
    for i, c in enumerate(choices):
        if host_bytes(p, choices, tuple(disk)) <= host_budget:
            break
        if not c.device_home:
            disk[i] = True
    if host_bytes(p, choices, tuple(disk)) > host_budget:
        disk[-1] = True
    on_disk = sum(_states(p, b) for b, d in zip((*p.blocks, p.rest), disk) if d)
    if host_bytes(p, choices, tuple(disk)) > host_budget or on_disk > disk_budget:
        return None
    return tuple(disk)
