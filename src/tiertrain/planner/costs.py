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


def saved_bytes(b: BlockProfile, c: Choice) -> int:
    """What the block keeps for backward between its forward and its backward."""
    return b.hidden_bytes if c.recompute else b.act_bytes


def device_bytes(b: BlockProfile, c: Choice, compute_bytes: int) -> int:
    own = 0 if c.stream else b.params * compute_bytes
    states = b.params * STATE_BYTES if c.device_home else 0
    acts = 0 if c.offload_hidden else saved_bytes(b, c)
    return own + states + acts


def optimizer_s(b: BlockProfile, m: MachineProfile, disk_home: bool) -> float:
    t = b.params / m.adam_params_per_s
    if disk_home:
        t += b.params * STATE_BYTES * (1 / m.disk_read_bps + 1 / m.disk_write_bps)
    return t


def block_seconds(b: BlockProfile, c: Choice, m: MachineProfile, compute_bytes: int, window: int,
                  disk_home: bool = False) -> float:
    fetch = b.params * compute_bytes / m.h2d_bps if c.stream else 0.0
    saved = saved_bytes(b, c)
    stash_out = saved / m.d2h_bps if c.offload_hidden else 0.0
    stash_in = saved / m.h2d_bps if c.offload_hidden else 0.0
    grads_out = b.params * GRAD_BYTES / m.d2h_bps
    recompute = b.forward_s if c.recompute else 0.0
    if window < 2 and c.stream:  # one slot: a block's copy cannot start while another computes
        fwd = b.forward_s + fetch + stash_out
        bwd = b.backward_s + recompute + fetch + stash_in + grads_out
    else:
        fwd = max(b.forward_s, fetch, stash_out)
        bwd = max(b.backward_s + recompute, fetch + stash_in, grads_out)
    opt = 0.0 if c.device_home and not m.device_is_host else optimizer_s(b, m, disk_home)
    return fwd + max(bwd, opt) + SWITCH_S * (c.stream + c.recompute + c.offload_hidden)


def fixed_device_bytes(p: Profile, window: int, any_stream: bool) -> int:
    """Device bytes no switch removes: the rest block, the streaming slots, and one block's
    activations in flight (a recomputed block rebuilds all of them during its backward)."""
    biggest = max(b.params for b in p.blocks) * p.compute_bytes
    working = max(b.act_bytes for b in p.blocks)
    return p.rest.params * p.compute_bytes + (window * biggest if any_stream else 0) + working


def switch_host_bytes(b: BlockProfile, c: Choice, compute_bytes: int) -> int:
    """Host bytes a block's switches add (its stash, its params' host copy); states are placed later."""
    return (saved_bytes(b, c) if c.offload_hidden else 0) + (b.params * compute_bytes if c.stream and compute_bytes != 4 else 0)


def base_host_bytes(p: Profile, disk_budget: int) -> int:
    """Host bytes no switch removes: every gradient, the rest block's states, and whatever states
    the disk cannot take."""
    states = sum(b.params for b in p.blocks) * STATE_BYTES
    return (sum(b.params for b in p.blocks) * GRAD_BYTES + p.rest.params * (STATE_BYTES + GRAD_BYTES)
            + max(0, states - disk_budget))


def host_bytes(p: Profile, choices: tuple[Choice, ...], disk_home: tuple[bool, ...]) -> int:
    """Host bytes: grads of every block, host-homed states, streamed params' host copies, stashes."""
    total = (p.rest.params) * (STATE_BYTES + GRAD_BYTES)
    for b, c, disk in zip(p.blocks, choices, disk_home):
        total += b.params * GRAD_BYTES
        if not c.device_home and not disk:
            total += b.params * STATE_BYTES
        total += switch_host_bytes(b, c, p.compute_bytes)
    return total


def homes(p: Profile, choices: tuple[Choice, ...], host_budget: int, disk_budget: int) -> tuple[bool, ...] | None:
    """Which host-homed blocks send their states to disk so the host fits (first blocks first:
    every block costs the same disk I/O). None when even that does not fit host and disk."""
    disk = [False] * len(choices)
    for i, c in enumerate(choices):
        if host_bytes(p, choices, tuple(disk)) <= host_budget:
            break
        if not c.device_home:
            disk[i] = True
    on_disk = sum(b.params * STATE_BYTES for b, d in zip(p.blocks, disk) if d)
    if host_bytes(p, choices, tuple(disk)) > host_budget or on_disk > disk_budget:
        return None
    return tuple(disk)
