"""STRONGHOLD's working window: streamed blocks take turns in a ring of device slots.

Streamed block j (j-th in streaming order) uses slot j % window. A slot may be refilled
with another block once its holder is done with it: in forward, as soon as the holder's
forward has run (backward fetches it again); in backward, once the holder's backward
has run. Prefetches follow from that: while block j computes, the next ``prefetch``
blocks in the direction of travel are copied in on worker threads.
"""

from __future__ import annotations

from typing import Callable

from tiertrain.memory.movement import Handle, Mover
from tiertrain.runtime.block_state import BlockState


class Window:
    def __init__(self, streamed: list[BlockState], mover: Mover, prefetch: int,
                 ready: Callable[[BlockState], None]) -> None:
        self.streamed = streamed
        self.order = {st.index: j for j, st in enumerate(streamed)}
        self.mover, self.prefetch = mover, prefetch
        self._ready = ready  # waits until a block's params are final (its update written back)
        self._inflight: dict[int, tuple[int, Handle]] = {}  # slot id -> (block index, copy)

    def _fetch(self, st: BlockState) -> Handle | None:
        """Start copying ``st`` into its slot unless it is there or on its way."""
        slot = st.slot
        key = id(slot)
        self._ready(st)  # an update may still rewrite this block's params (and unset holder)
        if key in self._inflight and self._inflight[key][0] == st.index:
            return self._inflight[key][1]
        if key in self._inflight:
            self._inflight.pop(key)[1].wait()  # the slot's previous copy must land before reuse
        if slot.holder == st.index:
            return None
        slot.holder = None
        handle = self.mover.copy(st.param_home, slot.chunk)
        self._inflight[key] = (st.index, handle)
        return handle

    def acquire(self, st: BlockState, step: int) -> None:
        """Make sure ``st`` sits in its slot now; prefetch the next blocks in direction ``step`` (+1 / -1)."""
        handle = self._fetch(st)
        if handle is not None:
            handle.wait()
            self._inflight.pop(id(st.slot), None)
            st.slot.holder = st.index
        j = self.order[st.index]
        for d in range(1, self.prefetch + 1):
            k = j + step * d
            if 0 <= k < len(self.streamed):
                self._fetch(self.streamed[k])

    def settle(self) -> None:
        """Wait for every copy in flight (end of a step, before updates rewrite homes)."""
        for key, (index, handle) in list(self._inflight.items()):
            handle.wait()
            st = next(s for s in self.streamed if s.index == index)
            st.slot.holder = index
        self._inflight.clear()

    def invalidate(self, st: BlockState) -> None:
        """After an update, a slot holding the old params must be refilled before use."""
        if st.slot.holder == st.index:
            st.slot.holder = None
