"""Moving disk-homed states to the host around their updates, and home again after.

A disk-homed block's master and moments are read in before its update (ahead of it, where the
plan's ``read_ahead`` and the update mode allow: ANGEL-PTM's trigger points) and written back
after it. One write-back per update worker is in flight at a time, which bounds the states the
host holds (the budget check and the planner count exactly that: ``plan.bytes.tier_bytes``); a
worker's next block is read in while its last write-back still goes out.
A chunk has one mover at a time: a read waits for the block's last write-back to land.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tiertrain.errors import BudgetError
from tiertrain.memory import Handle, MemorySystem, Tier
from tiertrain.plan.bytes import in_pieces
from tiertrain.runtime.slots import DeviceSlot

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup


class StateMoves:
    def __init__(self, mem: MemorySystem, read_ahead: int) -> None:
        self.mem = mem
        self.max_read_ahead = read_ahead        # blocks read in before their update (read_ahead's default)
        self._home: dict[int, list[Handle]] = {}   # block index -> write-backs in flight
        self._reads: dict[int, list[Handle]] = {}  # block index -> reads in flight
        self._local = threading.local()            # per worker: its last write-back
        self._lock = threading.Lock()

    def read_ahead(self, g: "BlockGroup", block: bool = True, slot: DeviceSlot | None = None, places: int | None = None) -> bool:
        """Start reading a disk-homed block's states now, so the reads overlap the backward of this and
        later blocks instead of following it. Skipped when ``places`` (default ``max_read_ahead``)
        blocks are already read in, and, with ``block=False``, while the block's last update or its
        write-back still runs (a forward-time trigger must never make the forward wait); such a trigger
        leaves the master of a block whose slot is filled from it on disk (the slot is filled from it in
        forward and backward). ``slot``: a device slot just filled from the block's fp32 master on disk,
        so its master is copied from there instead of read from disk again (also for a block whose other
        states were read in during forward), on a copy worker while backward goes on; the slot is not
        refilled before that copy is done. True once its reads are under way (or there is nothing to read)."""
        if g.plan.home is not Tier.DISK or g.master is None or in_pieces(g.plan):
            return True  # nothing to read, or read a piece at a time by the update itself
        if not block and not self._settled(g):
            return False
        with self._lock:
            reads = self._reads.get(g.index)
            begun = reads is not None
            if not begun:
                if len(self._reads) >= (self.max_read_ahead if places is None else places):
                    return False
                reads = self._reads[g.index] = []
        if not begun:
            self._read_states(g, reads, leave_master=(not block and g.fills_slot_from_disk) or slot is not None)
        self._master_from(g, slot, reads)
        return True

    def _read_states(self, g: "BlockGroup", reads: list[Handle], leave_master: bool) -> None:
        """A block's states on disk started into the host (its master too unless ``leave_master``), once
        its last write-back has landed."""
        for h in self._home.pop(g.index, []):
            h.wait()  # the last update's write-back must land before we read the states again
        try:
            for c in g.on_disk:
                if not (leave_master and c is g.master):
                    handle = self.mem.move(c, Tier.HOST, contiguous=True)
                    with self._lock:
                        reads.append(handle)
        except BudgetError:  # no room now: the update reads what is still on disk itself
            pass

    def _master_from(self, g: "BlockGroup", slot: DeviceSlot | None, reads: list[Handle]) -> None:
        """The master of a block being read in copied from ``slot`` (just filled from it), where it is
        still on disk; else its update reads it (``bring_in``)."""
        master = g.master
        if slot is None or master.tier is not Tier.DISK or not any(c is master for c in g.on_disk):
            return
        if master.pending is not None:  # already on its way (a block whose backward began twice: shared)
            return
        try:
            handle = self.mem.move_from(master, Tier.HOST, slot.chunk, contiguous=True)
        except BudgetError:
            return
        slot.read_by(handle)
        with self._lock:
            reads.append(handle)

    def reading_full(self) -> bool:
        """Whether ``max_read_ahead`` blocks are already read in (a further read_ahead within that many
        places starts no new block)."""
        with self._lock:
            return len(self._reads) >= self.max_read_ahead

    def written(self) -> bool:
        """Whether every write-back has landed."""
        return all(h.done() for moves in list(self._home.values()) for h in moves)

    def _settled(self, g: "BlockGroup") -> bool:
        return g.update_idle() and all(h.done() for h in self._home.get(g.index, []))

    def bring_in(self, g: "BlockGroup") -> None:
        """Before an update (on its worker): the block's reads landed, and whatever is still on disk
        read in, while this worker's last write-back may still be going out (the disk reads and
        writes at once: a block counts as being updated from its first read on, beside the one write-back
        per worker the host holds)."""
        with self._lock:
            reads = list(self._reads.get(g.index, []))
        if not reads:
            for h in self._home.pop(g.index, []):
                h.wait()
        for h in reads:
            h.wait()
        for h in [self.mem.move(c, Tier.HOST, contiguous=True) for c in g.states if c.tier is Tier.DISK]:
            h.wait()

    def send_home(self, g: "BlockGroup") -> None:
        """After an update: a disk-homed block's states start back to disk once this worker's last
        write-back has landed (one write-back per worker in flight bounds the states held in host:
        ``plan.bytes.tier_bytes``); the block is read in no more."""
        if g.plan.home is Tier.DISK:
            for h in getattr(self._local, "writeback", None) or []:
                h.wait()
            moves = [self.mem.move(c, Tier.DISK) for c in g.on_disk]
            self._home[g.index] = moves
            self._local.writeback = moves
        with self._lock:
            self._reads.pop(g.index, None)

    def settle(self, g: "BlockGroup") -> None:
        """Return once the block's params are final (before reading them): its update is done and,
        where its slot is filled from the fp32 master itself on disk, the master's write-back has landed.

        Other blocks' params were published before the write-back began (a host param home or their
        device slot), so the next forward runs while their states go home to disk: that write-back
        overlaps compute instead of the forward waiting for it. The states' next reader
        (``read_ahead``, ``bring_in``) waits for it instead."""
        g.wait_update()
        if g.fills_slot_from_disk:
            for h in self._home.pop(g.index, []):
                h.wait()

    def drain(self) -> None:
        """Wait for every write-back to disk, and every read in flight (before checkpoints or closing: a
        read not followed by its update, as after a skipped fp16 step, may still be moving a chunk)."""
        for moves in self._home.values():
            for h in moves:
                h.wait()
        self._home.clear()
        with self._lock:
            reads = [h for moves in self._reads.values() for h in moves]
        for h in reads:
            h.wait_done()  # a failed read left its chunk where it was; its update reports the error

