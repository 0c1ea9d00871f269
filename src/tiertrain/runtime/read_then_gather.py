"""A sharded block's gather whose own shard is first read from disk, off the step's thread.

A streamed sharded block whose fp32 master lives on disk fills its slot from that master: this
rank's shard is read into its place in the slot, then every rank's shard is all-gathered. Read on
the step's thread, the read stalled compute for as long as the disk took (a block's shard from NVMe is
far slower than its gather over NVLink). The read now runs on the memory system's read workers from
the moment the device cache prefetches the block; the gather is issued on the step's thread at the
cache's next access (``issue``) or when the slot is needed (``wait``), points every rank reaches in
the same order, never at the moment the read happens to land: so the ranks' collectives stay in one
order. The read so has one block's compute to hide under, and the gather runs as its block is about to
compute (the read was what took long: a shard from NVMe against a gather over NVLink); the simulator
still hides both (``planner.simulator._fetch``). A resident sharded block's gather started ahead
(``BlockGroup.gather_ahead``) reads so too, its gather issued when the block needs its slot.
"""

from __future__ import annotations

from collections.abc import Callable

from tiertrain.memory.movement import Handle
from tiertrain.parallel.collectives import Waitable


class ReadThenGather:
    def __init__(self, read: Handle, gather: Callable[[], Waitable | None]) -> None:
        self._read, self._gather = read, gather
        self._work: Waitable | None = None
        self._error: BaseException | None = None

    def issue(self) -> None:
        """Wait for the shard's read, then start the gather (once). A read that failed (a short read, a bad
        page) raises here, before this rank joins the gather, and again at every later call: the slot it
        was to fill holds no block."""
        if self._error is not None:
            raise self._error
        if self._gather is None:
            return
        try:
            self._read.wait()
        except BaseException as exc:
            self._error, self._gather = exc, None
            raise
        gather, self._gather = self._gather, None
        self._work = gather()

    def wait(self) -> None:
        self.issue()
        if self._work is not None:
            self._work.wait()
