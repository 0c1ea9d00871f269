"""The device slots streamed blocks take turns in: STRONGHOLD's window plus Elixir's cache.

``window + cache`` slots hold the compute params of streamed blocks. A block that is
needed and not resident takes a free slot or evicts one: the holder whose next use lies
furthest ahead (Belady) in the access order. That order is predicted for the first pass
(forward in block order, backward in reverse) and from then on is the order the previous
pass recorded, so recompute, shared blocks or a model calling its blocks out of order are
all served from what really happened (Elixir's warm-up step).

Prefetch is a task queue with trigger points (ANGEL-PTM): when access ``p`` begins, the
blocks of accesses ``p+1 .. p+prefetch`` are copied in on worker threads, provided the slot
Belady would free for each is not needed before it (else it is fetched on demand). A sharded
block's own shard on disk is read so too, its gather issued at the next access
(``runtime.read_then_gather``).

Blocks move between slots, so their parameters are re-pointed (``Tensor.set_``) at the new
slot; autograd's saved views of them are rebuilt at unpack time (``switches.SavedTensors``).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from typing import TYPE_CHECKING

from tiertrain.memory.movement import Handle
from tiertrain.runtime.read_then_gather import ReadThenGather
from tiertrain.runtime.slots import DeviceSlot

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup

NEVER = float("inf")


class DeviceCache:
    def __init__(self, streamed: list["BlockGroup"], slots: list[DeviceSlot], prefetch: int) -> None:
        self.blocks = {st.index: st for st in streamed}
        self.slots, self.prefetch = slots, prefetch
        self._inflight: dict[int, Handle] = {}  # block index -> copy into its slot
        self._stale: set[int] = set()           # blocks rewritten at home since their slot was filled
        self._stale_lock = threading.Lock()     # updaters add to it; only this (main) thread takes out
        predicted = [st.index for st in streamed]
        self._set_order(predicted + predicted[::-1])
        self.trace: list[int] = []   # this pass's accesses
        self.pos = -1                # position of the current access in ``order``
        self.lost = False            # this pass left the recorded order: evict least recently used
        self.current: int | None = None
        self._last_use: dict[int, int] = {}
        self.fetches = 0             # copies into slots since the last ``pop_fetches``
        self.prefetched = 0          # of those over the run, how many a trigger started ahead of use

    # -- order -------------------------------------------------------------------------
    def _set_order(self, order: list[int]) -> None:
        self.order = order
        self._uses: dict[int, list[int]] = {}
        for q, b in enumerate(order):
            self._uses.setdefault(b, []).append(q)

    def next_use(self, block: int, after: int) -> float:
        uses = self._uses.get(block, [])
        k = bisect_right(uses, after)
        return uses[k] if k < len(uses) else NEVER

    def new_pass(self) -> None:
        """A forward pass begins: the previous pass's accesses become the order to plan by."""
        if self.trace:
            self._set_order(self.trace)
        self.trace, self.pos, self.lost = [], -1, False

    def _advance(self, block: int) -> None:
        nxt = self.next_use(block, self.pos)
        if self.lost or nxt == NEVER:
            self.lost = True
        else:
            self.pos = int(nxt)

    # -- residency ---------------------------------------------------------------------
    def acquire(self, st: "BlockGroup") -> None:
        """Make sure ``st`` sits in a slot now, then start the prefetches this access triggers."""
        self.trace.append(st.index)
        self._last_use[st.index] = len(self.trace)
        self._advance(st.index)
        self.current = st.index
        self._issue_gathers()
        handle = self._fetch(st, self.pos, demand=True)
        if handle is not None:
            handle.wait()
            self._inflight.pop(st.index, None)
        if self.lost:
            return
        for q in range(self.pos + 1, min(len(self.order), self.pos + 1 + self.prefetch)):
            self._fetch(self.blocks[self.order[q]], q, demand=False)

    def _issue_gathers(self) -> None:
        """The gathers of blocks prefetched from disk-homed shards (``ReadThenGather``), in the order they
        were fetched: every rank reaches each access in one order, so every rank issues them alike."""
        for handle in list(self._inflight.values()):
            if isinstance(handle, ReadThenGather):
                handle.issue()

    def _resident(self, st: "BlockGroup") -> bool:
        return st.slot.holder == st.index

    def _fetch(self, st: "BlockGroup", at: int, demand: bool) -> Handle | None:
        """Start copying ``st`` into a slot unless it is there or on its way; None when it is there
        (or, for a prefetch, when no slot may be taken for it yet)."""
        st.await_params()  # an update may still rewrite this block's params (and invalidate its copy)
        if st.index in self._inflight:
            return self._inflight[st.index]  # a copy that began before a publish leaves the mark for next time
        stale = self._take_stale(st)
        if self._resident(st) and not stale:
            return None
        if self._resident(st):
            st.slot.holder = None  # refilled in place: its own slot is free now
        slot = self._take_slot(st, at, demand)
        if slot is None:
            return None
        slot.holder = st.index
        slot.wait_readers()  # a master still being copied out of it (``StateMoves.read_ahead``)
        handle = st.fill(slot)
        self._inflight[st.index] = handle
        self.fetches += 1
        self.prefetched += not demand
        return handle

    def _take_slot(self, st: "BlockGroup", at: int, demand: bool) -> DeviceSlot | None:
        """A slot for ``st``'s access at ``at``: a free one, else Belady's victim at that access. A
        prefetch takes it now only if that victim is not needed before ``at`` (nor computing now),
        so prefetching never adds a fetch to what demand fetching would do."""
        free = [s for s in self.slots if s.holder is None]
        if free:
            return st.slot if st.slot in free else free[0]
        pinned = (st.index, self.current) if demand else (st.index,)
        candidates = [s for s in self.slots if s.holder not in pinned]
        if not candidates:
            if demand:
                raise RuntimeError("no device slot can be freed for a streamed block; the plan needs window >= 1")
            return None
        victim = max(candidates, key=lambda s: self._eviction_key(s, at))
        if not demand and (victim.holder == self.current or self.next_use(victim.holder, self.pos) < at):
            return None
        old = victim.holder
        if old in self._inflight:
            self._inflight.pop(old).wait()  # its copy must land before the slot is written again
        victim.holder = None
        return victim

    def _eviction_key(self, slot: DeviceSlot, at: int) -> float:
        if self.lost:
            return -self._last_use.get(slot.holder, 0)  # least recently used first
        return self.next_use(slot.holder, at)           # Belady: needed furthest ahead first

    def settle(self) -> None:
        """Wait for every copy in flight (end of a step, before updates rewrite homes)."""
        for handle in self._inflight.values():
            handle.wait()
        self._inflight.clear()

    def invalidate(self, st: "BlockGroup") -> None:
        """Any thread: the block's params were rewritten at home, so its slot is refilled at its next access.

        Only marks it. Slots change hands in the main thread alone: an updater that cleared a
        holder itself could pull a slot from under the backward that is using it (lockfree
        publishes at any moment), or free a slot the main thread had just given to another block."""
        if st.plan.stream:
            with self._stale_lock:
                self._stale.add(st.index)

    def _take_stale(self, st: "BlockGroup") -> bool:
        with self._stale_lock:
            if st.index in self._stale:
                self._stale.discard(st.index)
                return True
            return False

    def pop_fetches(self) -> int:
        n, self.fetches = self.fetches, 0
        return n
