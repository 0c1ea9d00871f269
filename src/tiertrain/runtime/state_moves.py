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
from concurrent.futures import Future

from tiertrain.errors import BudgetError
from tiertrain.memory import Handle, MemorySystem, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.plan.bytes import in_pieces
from tiertrain.runtime.block_group import BlockGroup


class StateMoves:
    def __init__(self, mem: MemorySystem, read_ahead: int) -> None:
        self.mem = mem
        self.max_read_ahead = read_ahead        # blocks whose disk states may be read in before their update
        self._home: dict[int, list[Handle]] = {}   # block index -> write-backs in flight
        self._reads: dict[int, list[Handle]] = {}  # block index -> reads in flight
        self._local = threading.local()            # per worker: its last write-back
        self._lock = threading.Lock()

    def read_ahead(self, g: BlockGroup, block: bool = True, slot: Chunk | None = None) -> bool:
        """Start reading a disk-homed block's states now, so the reads overlap the backward of this and
        later blocks instead of following it. Skipped when ``max_read_ahead`` blocks are already read
        in, and, with ``block=False``, while the block's last update or its write-back still runs (a
        forward-time trigger must never make the forward wait). ``slot``: a device slot just filled
        from the block's fp32 master on disk, so its master is copied from there instead of read from
        disk again. True once its reads are under way (or there is nothing to read)."""
        if g.plan.home is not Tier.DISK or g.master is None or in_pieces(g.plan):
            return True  # nothing to read, or read a piece at a time by the update itself
        if not block and not self._settled(g):
            return False
        with self._lock:
            if g.index in self._reads:
                return True
            if len(self._reads) >= self.max_read_ahead:
                return False
            self._reads[g.index] = []
        for h in self._home.pop(g.index, []):
            h.wait()  # the last update's write-back must land before we read the states again
        reads = []
        try:
            on_disk = g.on_disk
            from_slot = g.master if slot is not None and any(c is g.master for c in on_disk) else None
            for c in on_disk:  # the disk's reads queued first, then the master copied from the slot
                if c is not from_slot:
                    reads.append(self.mem.move(c, Tier.HOST, contiguous=True))
            if from_slot is not None:
                reads.append(self.mem.move_from(from_slot, Tier.HOST, slot, contiguous=True))
        except BudgetError:  # no room now: the update reads what is still on disk itself
            pass
        with self._lock:
            self._reads[g.index] = reads
        return True

    def reading_full(self) -> bool:
        """Whether ``max_read_ahead`` blocks are already read in (a further read_ahead does nothing)."""
        with self._lock:
            return len(self._reads) >= self.max_read_ahead

    def _settled(self, g: BlockGroup) -> bool:
        pending = g.pending
        return (pending is None or pending.done()) and all(h.done() for h in self._home.get(g.index, []))

    def bring_in(self, g: BlockGroup) -> None:
        """Before an update (on its worker): the block's reads landed, and whatever is still on disk
        read in, while this worker's last write-back may still be going out (the disk reads and
        writes at once: a block counts as being updated from its first read on, beside the one write-back
        per worker the host holds)."""
        with self._lock:
            reads = self._reads.get(g.index, [])
        if not reads:
            for h in self._home.pop(g.index, []):
                h.wait()
        for h in reads:
            h.wait()
        for h in [self.mem.move(c, Tier.HOST, contiguous=True) for c in g.states if c.tier is Tier.DISK]:
            h.wait()

    def send_home(self, g: BlockGroup) -> None:
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

    def settle(self, g: BlockGroup) -> None:
        """Return once the block's params are final (before reading them): its update is done and,
        where its slot is filled from the fp32 master itself on disk, the master's write-back has landed.

        Other blocks' params were published before the write-back began (a host param home or their
        device slot), so the next forward runs while their states go home to disk: that write-back
        overlaps compute instead of the forward waiting for it. The states' next reader
        (``read_ahead``, ``bring_in``) waits for it instead."""
        if g.pending is not None:
            g.pending.result()
        if g.fills_slot_from_disk:
            for h in self._home.pop(g.index, []):
                h.wait()

    def drain(self) -> None:
        """Wait for every write-back to disk (before checkpoints or closing)."""
        for moves in self._home.values():
            for h in moves:
                h.wait()
        self._home.clear()


def wait(pending: Future | None) -> None:
    """Wait for an update in flight (re-raising its error here)."""
    if pending is not None:
        pending.result()
