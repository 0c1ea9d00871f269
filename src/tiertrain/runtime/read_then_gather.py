"""A sharded block's gather whose own shard is first read from disk, off the step's thread.

A streamed sharded block whose fp32 master lives on disk fills its slot from that master: this
rank's shard is read into its place in the slot, then every rank's shard is all-gathered. Read on
the step's thread, the read stalled compute for as long as the disk took (a block's shard from NVMe is
far slower than its gather over NVLink). The read now runs on the memory system's read workers from
the moment the device cache prefetches the block; the gather is issued on the step's thread at the
cache's next access (``issue``) or when the slot is needed (``wait``), points every rank reaches in
the same order, never at the moment the read happens to land: so the ranks' collectives stay in one
order. With prefetch depth 1 the gather then runs just before its block computes (the read was what
took long); depth 2 overlaps both (``Plan.prefetch``). A resident sharded block's gather started ahead
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

    @property
    def issued(self) -> bool:
        return self._gather is None

    def issue(self) -> None:
        """Wait for the shard's read, then start the gather (once)."""
        if self._gather is None:
            return
        gather, self._gather = self._gather, None
        self._read.wait()  # a short read or a bad page raises here, before this rank joins the gather
        self._work = gather()

    def wait(self) -> None:
        self.issue()
        if self._work is not None:
            self._work.wait()
