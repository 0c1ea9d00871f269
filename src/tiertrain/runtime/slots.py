"""Device slots: regions of the device pool that hold one block's compute params at a time.

The module's parameters are replaced once, at setup, by tensors that alias a slot
(``Tensor.set_`` onto the pool's storage). Refilling a slot writes the pool buffer, never these
tensors, so no ``.data`` swap is needed and autograd's saved parameters stay valid as long as
the slot holds the block when its backward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiertrain.memory import ChunkLayout
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.movement import Handle


@dataclass
class DeviceSlot:
    chunk: Chunk
    holder: int | None = None  # index of the block whose params are in it
    readers: list[Handle] = field(default_factory=list)  # copies out of it in flight

    def read_by(self, handle: Handle) -> None:
        """A copy out of the slot is in flight (a master taken from it: ``StateMoves.read_ahead``):
        the slot is not written again until it is done."""
        self.readers = [h for h in self.readers if not h.done()] + [handle]

    def wait_readers(self) -> None:
        """Before the slot is written: every copy out of it has finished (one that failed reports its
        error to the update waiting for it, not here)."""
        for h in self.readers:
            h.wait_done()
        self.readers = []


def slot_base(slot: DeviceSlot) -> tuple[torch.UntypedStorage, int]:
    """The device pool's storage and the slot's byte offset in it."""
    flat = slot.chunk.merge()
    return flat.untyped_storage(), flat.storage_offset()  # uint8 storage: offsets in bytes


def alias(slot: DeviceSlot, layout: ChunkLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of each parameter's shape living in the slot's memory, with their own version counters."""
    storage, base = slot_base(slot)
    out = []
    for s in layout.slots:
        t = torch.empty(0, dtype=dtype, device=storage.device)
        t.set_(storage, (base + s.offset * dtype.itemsize) // dtype.itemsize, s.shape)
        out.append(t)
    return out


def point_at(params: list[torch.Tensor], layout: ChunkLayout, dtype: torch.dtype, slot: DeviceSlot) -> None:
    """Point a block's parameters at another slot (the device cache moved it).

    ``set_`` counts as an in-place change, which would make autograd refuse the parameters it
    saved in forward; the values are the same block's, so the version counters are put back
    (torch's ``_unsafe_set_version_counter``, made for exactly this kind of storage swap).
    Saved *views* of the parameters are rebuilt from the new slot at unpack time instead."""
    storage, base = slot_base(slot)
    versions = tuple(p._version for p in params)
    size = dtype.itemsize
    with torch.no_grad():
        for p, s in zip(params, layout.slots):
            p.set_(storage, (base + s.offset * size) // size, s.shape)
    torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
