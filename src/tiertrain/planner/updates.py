"""The simulator's block updates, in the pipeline the runtime runs them in (``runtime.state_moves``,
``runtime.modes``): a plan's ``update_workers`` and ``read_ahead`` decide when each update can start.

- An update runs on one of ``update_workers`` workers (sync: the loop's own thread, one), which is
  taken from the update's start to its AdamW's end, and, for a disk-homed block, until that worker's
  last write-back has landed, before it starts its own (one write-back per worker in flight bounds
  the states the host holds); its reads overlap that last write-back. A block updated in pieces
  (``runtime.pieces``) holds its worker until its last piece is written. A device-homed block on a
  GPU takes a worker only to start its update there.
- A disk-homed block's states are read ahead of its update (``plan.reads``): during forward, the first
  ``read_ahead`` blocks backward reaches (a block whose slot is filled from its master on disk leaves
  that master there: it is copied from the slot as its backward begins, or, sharded, read by its
  update), and where updates follow backward (``follows_backward``) the next ``2 * update_workers``
  too, into the workers' places (optimistic: the runtime waits for the last step's write-backs and
  updates first, which this one replayed step does not have, and for a backward that showed every
  such block flushing as it came); then each block as its backward begins, once its slot is filled, if
  fewer than ``read_ahead`` are read in (a slot filled from its master on disk gives it the master: only
  the moments come from disk). A place frees when the update
  of a block read ahead has finished (its worker's last write-back landed). A block not read ahead is
  read by its worker as its update starts.
  Lockfree reads nothing ahead (a block's loop may be moving its states).
- ``overlap``: the next step's forward needs each block's new params. So a step is at least as long
  as the latest update, counted from where that block's params are needed in the step (its fetch for
  a streamed block, its forward otherwise, the embeddings at once), plus the write-back where the
  slot is filled from the master on disk (``BlockGroup.fills_slot_from_disk``).

Where the runtime bounds the gradients updated away (``plan.bytes.bounds_grads``), backward waits,
before it flushes a block's gradients, until at most ``update_workers`` chunks are alive
(``Runtime._room_for_grads``, which looks again as each update finishes): ``room_for_grads`` says when.

Not modelled: the forward-time reads start with block 0's fetch, not after the prefetches it submits;
a sharded resident block whose slot is gathered from its master on disk counts as any resident block;
host and device gradient chunks are bounded as one count.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from tiertrain.plan import BlockPlan, Plan
from tiertrain.plan.bytes import (F32_BYTES, disk_states, grad_tier, in_pieces, master_home, pages,
                                  separate_param_home, sharded, updated_away)
from tiertrain.plan.update_modes import disk_passes_per_step, rules
from tiertrain.plan.reads import forward_reads
from tiertrain.plan.tiers import Tier
from tiertrain.planner.costs import GRAD_BYTES, publishes_over_link
from tiertrain.planner.network import Network
from tiertrain.planner.profile import BlockProfile, Profile
from tiertrain.planner.timeline import Timeline

Change = Callable[..., None]   # the simulator's memory curve: change(time, tier, delta, away=False)


def network(plan: Plan, p: Profile) -> Network:
    """The profile's collective rates over the plan's ranks."""
    return dataclasses.replace(p.network, dp=plan.parallel.dp, shard_ranks=plan.parallel.shard_group,
                               ep=plan.parallel.ep)


def own(plan: Plan, bp: BlockPlan, numel: int) -> int:
    """Elements of a block's states one rank holds and updates."""
    return -(-numel // plan.parallel.shard_ranks) if sharded(bp, plan) else numel


def own_of(plan: Plan, bp: BlockPlan, b: BlockProfile) -> int:
    """A profiled block's elements one rank holds and updates: its share of the block, and its held experts."""
    return own(plan, bp, b.shared) + b.experts


def fills_slot_from_disk(bp: BlockPlan, plan: Plan) -> bool:
    """A streamed block whose slot is filled from its fp32 master on disk (no other copy of its params)."""
    return bp.stream and master_home(bp) is Tier.DISK and not separate_param_home(bp, plan)


def master_feeds_slot(bp: BlockPlan, plan: Plan) -> bool:
    """A block whose slot (or, sharded, its part of it) is filled from its fp32 master on disk, so a
    read during forward leaves that master there (``BlockGroup.fills_slot_from_disk``)."""
    return (bp.stream or sharded(bp, plan)) and master_home(bp) is Tier.DISK and not separate_param_home(bp, plan)


def disk_bytes(bp: BlockPlan) -> int:
    """Bytes per parameter a disk-homed block's update reads and writes back: its fp32 states on disk."""
    return disk_states(bp) * F32_BYTES


@dataclass
class _Worker:
    free: float = 0.0      # when it may take the next update
    written: float = 0.0   # when its last write-back lands


@dataclass
class UpdatePipeline:
    plan: Plan
    p: Profile
    tl: Timeline
    change: Change
    workers: list[_Worker]
    read_ahead: int
    bounded: bool                                  # backward waits for room for gradients
    follows_backward: bool                         # updates start as backward frees each block's gradients
    reads: dict[int, float] = field(default_factory=dict)      # block -> when its read-ahead lands
    held: dict[int, float] = field(default_factory=dict)       # block read ahead -> when its place frees
    master_left: set[int] = field(default_factory=set)         # blocks read ahead whose master is still on disk
    settled: dict[int, float] = field(default_factory=dict)    # block -> when its params are final
    away_done: list[float] = field(default_factory=list)       # updates that free bounded chunks, in order

    @classmethod
    def of(cls, plan: Plan, p: Profile, tl: Timeline, change: Change, bounded: bool,
           follows_backward: bool) -> "UpdatePipeline":
        mode = rules(plan.update)
        workers = 1 if mode.waits_at_step else plan.update_workers  # a step's updates: one after another
        read_ahead = plan.read_ahead if mode.reads_ahead else 0
        return cls(plan, p, tl, change, [_Worker() for _ in range(workers)], read_ahead, bounded, follows_backward)

    def _block(self, i: int) -> tuple[BlockPlan, BlockProfile]:
        """Block ``i``'s plan and profile; ``len(p.blocks)``: the rest's."""
        if i == len(self.p.blocks):
            return self.plan.rest, self.p.rest
        return self.plan.blocks[i], self.p.blocks[i]

    def _read_s(self, bp: BlockPlan, numel: float) -> float:
        """Seconds to read ``numel`` parameters' disk states of a block."""
        return numel * disk_bytes(bp) / self.p.machine.disk_read_bps

    def _share(self, bp: BlockPlan) -> float:
        """The step's share of a disk-homed block's update (lockfree passes every few steps)."""
        return disk_passes_per_step(self.plan.update, self.plan.max_staleness) if bp.home is Tier.DISK else 1.0

    def _reads_ahead(self, bp: BlockPlan) -> bool:
        return bp.home is Tier.DISK and not in_pieces(bp) and self.read_ahead > 0

    def forward_reads(self, t: float) -> None:
        """As forward starts: the blocks ``plan.reads.forward_reads`` names (those read once updates are
        idle only where updates follow backward; the runtime waits for the last step's write-backs)."""
        if not self.read_ahead:
            return
        reads = forward_reads(self.plan)
        order = reads.first + (reads.while_idle if self.follows_backward else ())
        for i in order:
            self.read(i, t, leave_master=master_feeds_slot(self.plan.blocks[i], self.plan), places=len(order))

    def read(self, i: int, t: float, from_slot: bool = False, leave_master: bool = False,
             places: int | None = None) -> None:
        """A block's states read ahead from ``t``, if it is not already and a place is free then (of
        ``places``, default ``read_ahead``); its master left on disk where ``leave_master``.
        ``from_slot``: its master is copied from the device slot just filled from it (``StateMoves.read_ahead``),
        not read from disk (``t``: once the fill has landed)."""
        bp, b = self._block(i)
        if not self._reads_ahead(bp):
            return
        n = self._share(bp) * own_of(self.plan, bp, b)
        m = self.p.machine
        if i not in self.reads:
            if sum(1 for end in self.held.values() if end > t) >= (self.read_ahead if places is None else places):
                return
            left = leave_master or from_slot
            seconds = self._read_s(bp, n) - (n * F32_BYTES / m.disk_read_bps if left else 0.0)
            self.reads[i] = self.tl.run("disk_read", t, seconds, f"read {b.name}")[1]
            self.held[i] = math.inf  # until its update ends
            if left:
                self.master_left.add(i)
        if from_slot and i in self.master_left:
            self.master_left.discard(i)
            copied = self.tl.run("d2h", t, n * F32_BYTES / m.d2h_bps, f"master {b.name} from its slot")[1]
            self.reads[i] = max(self.reads[i], copied)

    def room_for_grads(self) -> float:
        """When backward may flush the next bounded block's gradients: at most ``update_workers``
        chunks alive, so all but ``update_workers`` of the updates of those flushed before have freed theirs."""
        k = len(self.away_done) - len(self.workers) - 1
        return sorted(self.away_done)[k] if k >= 0 else 0.0

    def update(self, i: int, ready: float) -> float:
        """Block ``i``'s update (``len(p.blocks)``: the rest) once its gradients are in at ``ready``;
        when its AdamW ends (and frees its gradients)."""
        plan, p, m, tl = self.plan, self.p, self.p.machine, self.tl
        bp, b = self._block(i)
        name, n = b.name, own_of(plan, bp, b)
        share = self._share(bp)
        worker = min(self.workers, key=lambda w: w.free)
        if bp.home is Tier.DEVICE and not m.device_is_host:
            done = max(ready, worker.free)  # updated on the GPU, next to nothing beside its compute (as costs has it)
        else:
            done = self._adam(i, bp, max(ready, worker.free), share * n, name)
        waits = bp.home is Tier.DISK and not in_pieces(bp)  # for the worker's last write-back (``send_home``)
        finished = max(done, worker.written) if waits else done
        worker.free = finished
        if i in self.held:
            self.held[i] = finished
        self.change(done, grad_tier(bp).value, -pages(n * GRAD_BYTES, p.page, bound=False), updated_away(bp))
        if self.bounded and updated_away(bp):
            self.away_done.append(finished)
        if publishes_over_link(bp.stream, bp.home is Tier.DEVICE, m, p.compute_bytes):
            tl.run("h2d", done, share * n * p.compute_bytes / m.h2d_bps, f"publish {name}")
        if sharded(bp, plan) and not bp.stream:  # the new params of every rank's share into the slot
            tl.run("net", done, share * network(plan, p).gather_s(b.shared * p.compute_bytes), f"gather {name}")
        self.settled[i] = finished
        if bp.home is Tier.DISK:
            written = tl.run("disk_write", finished, share * n * disk_bytes(bp) / m.disk_write_bps, f"write {name}")[1]
            worker.written = written
            if in_pieces(bp):  # its pieces are written before its update returns
                worker.free = self.settled[i] = written
            if fills_slot_from_disk(bp, plan):
                self.settled[i] = written
        return done

    def _adam(self, i: int, bp: BlockPlan, start: float, numel: float, name: str) -> float:
        """The states in (read ahead, else read now; in pieces, a piece ahead of AdamW), then AdamW."""
        m, tl = self.p.machine, self.tl
        ready, read_end = start, 0.0
        if bp.home is Tier.DISK:
            seconds = self._read_s(bp, numel)
            if i in self.reads:
                ready = max(start, self.reads[i])
                if i in self.master_left:  # not copied from a slot: read now
                    ready = self.tl.run("disk_read", ready, numel * F32_BYTES / m.disk_read_bps, f"read {name}'s master")[1]
            elif in_pieces(bp):
                first = min(seconds, disk_states(bp) * bp.piece / m.disk_read_bps)
                begun, read_end = tl.run("disk_read", start, seconds, f"read {name}")
                ready = begun + first
            else:
                ready = tl.run("disk_read", start, seconds, f"read {name}")[1]
        return max(read_end, tl.run("cpu", ready, numel / m.adam_params_per_s, f"adam {name}")[1])

    def chain(self, needed: dict[int, float]) -> float:
        """The shortest step that lets the next step's forward find every block's params final:
        ``needed`` says, per block, when this step needed them (the rest's at 0)."""
        return max((self.settled[i] - t for i, t in needed.items() if i in self.settled), default=0.0)
