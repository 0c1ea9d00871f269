"""What a block's forward leaves for backward: H3T's activation switches (§3.2), and views of
parameters that must survive the block moving between device slots.

``recompute``: keep only the block's input and rerun its forward inside backward
(``torch.utils.checkpoint``, non-reentrant, so the block's hooks fire again as they should).
``offload_hidden``: what autograd saves inside the block (with ``recompute``: just the
hidden state entering it) goes to a host chunk as soon as it is saved and comes back
when backward unpacks it. The tensors are whatever autograd saves (``saved_tensors_hooks``),
so no model code changes; parameters are never copied (they live in device slots already).
A streamed block may come back for backward in another slot (``cache.DeviceCache``): a saved
view of its parameters (a transposed weight) is kept as its place in the block's slot and
rebuilt on the slot the block holds when backward unpacks it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.utils.checkpoint as ckpt

from tiertrain.errors import BudgetError
from tiertrain.memory import Kind, MemorySystem, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.runtime.block_group import BlockGroup
from tiertrain.runtime.slots import slot_base


class _Stashed:
    """A saved tensor's bytes in a host chunk; the chunk is freed with the autograd node that holds this."""

    __slots__ = ("mem", "chunk", "shape", "stride", "dtype", "device", "event", "ready", "__weakref__")

    def __init__(self, mem: MemorySystem, chunk: Chunk, t: torch.Tensor) -> None:
        self.mem, self.chunk = mem, chunk
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device
        self.host_view().copy_(t.reshape(-1), non_blocking=t.device.type == "cuda")
        self.event, self.ready = None, None
        if t.device.type == "cuda":  # freed unrestored (a graph dropped), the chunk waits for this copy
            self.event = torch.cuda.Event()
            self.event.record()

    def host_view(self) -> torch.Tensor:
        return self.chunk.typed(self.dtype)[: self.shape.numel()]

    def prefetch(self, stream: torch.cuda.Stream | None) -> None:
        """Copy the tensor back now, ahead of the backward that reads it (on a GPU on ``stream``, beside the
        compute); ``restore`` then hands this copy over."""
        if self.ready is not None or stream is None:  # on a CPU the copy would gain nothing and hold more
            return
        with torch.cuda.stream(stream):  # ``HostStash.prefetch`` made it wait for the packs' copies first
            self.ready = self._copy()
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def restore(self) -> torch.Tensor:
        if self.ready is not None:
            out, self.ready = self.ready, None
            if self.device.type == "cuda":  # made on the copy stream: the compute waits for it, and it is
                torch.cuda.current_stream().wait_event(self.event)  # freed only once the compute is done
                out.record_stream(torch.cuda.current_stream())
            return out
        out = self._copy()
        if self.device.type == "cuda":  # the host chunk may be reused only once this copy has read it
            self.event = torch.cuda.Event()  # (recorded after the pack's copy, on the same stream)
            self.event.record()
        return out

    def _copy(self) -> torch.Tensor:
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        out.view(-1).copy_(self.host_view(), non_blocking=self.device.type == "cuda")
        return out

    def __del__(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        if not self.chunk.released:
            self.mem.release(self.chunk)


class HostStash:
    """pack/unpack hooks that keep one block's saved activations on the host."""

    def __init__(self, mem: MemorySystem, name: str) -> None:
        self.mem, self.name = mem, name
        self.stashed_bytes = 0   # over the run: bytes moved to the host
        self.kept = 0            # tensors left where they were (host budget full, or not dense)
        self.stashed = 0         # over the run: tensors moved to the host
        self.micro: int | None = None  # the pipeline micro-batch whose forward runs (``micro_batch``)
        self.prefetched = 0      # over the run: tensors copied back ahead of their backward (``prefetch``)
        self._by_micro: dict[int, list[weakref.ref]] = {}
        self._device = mem.pool(Tier.DEVICE).device
        self._stream: torch.cuda.Stream | None = None  # the prefetch's copy stream, made at its first use (GPU)

    def pack(self, t: torch.Tensor) -> Any:
        if not t.is_contiguous():
            return t
        nbytes = t.numel() * t.element_size()
        try:
            chunk = self.mem.allocate(f"{self.name}.act", max(nbytes, 1), Tier.HOST, Kind.ACTIVATION, contiguous=True)
        except BudgetError:  # no host room now: keeping it on the device is slower to free, never wrong
            self.kept += 1
            return t
        self.stashed_bytes += nbytes
        self.stashed += 1
        stashed = _Stashed(self.mem, chunk, t)
        if self.micro is not None:
            self._by_micro.setdefault(self.micro, []).append(weakref.ref(stashed))
        return stashed

    def new_step(self) -> None:
        self._by_micro.clear()

    def prefetch(self, micro: int) -> None:
        """AIAO's prefetch (FOLD3D §4): the stashed tensors of pipeline micro-batch ``micro`` copied back to the
        device now, a micro-batch ahead of their backward, so it does not wait for them (on a GPU; on a CPU they
        are counted, nothing is copied twice). Those already freed (a dropped graph) are skipped."""
        refs = self._by_micro.pop(micro, [])
        stream = self._copy_stream() if refs else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # after the packs' copies into their chunks
        for ref in refs:
            stashed = ref()
            if stashed is not None:
                stashed.prefetch(stream)
                self.prefetched += 1

    def _copy_stream(self) -> torch.cuda.Stream | None:
        if self._stream is None and self._device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self._device)
        return self._stream

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.restore() if isinstance(packed, _Stashed) else packed


class _SlotView:
    """A saved view of a streamed block's parameters, as its place in whatever slot holds the block."""

    __slots__ = ("st", "offset", "shape", "stride", "dtype")

    def __init__(self, st: BlockGroup, offset: int, t: torch.Tensor) -> None:
        self.st, self.offset, self.shape, self.stride, self.dtype = st, offset, t.shape, t.stride(), t.dtype

    def restore(self) -> torch.Tensor:
        if self.st.slot.holder != self.st.index:
            raise RuntimeError(f"internal: block {self.st.block.name} is not in a device slot when its backward runs")
        storage, base = slot_base(self.st.slot)
        t = torch.empty(0, dtype=self.dtype, device=storage.device)
        return t.set_(storage, (base + self.offset) // self.dtype.itemsize, self.shape, self.stride)


class SavedTensors:
    """The pack/unpack hooks of one block's forward."""

    def __init__(self, st: BlockGroup, mem: MemorySystem, stash: HostStash | None) -> None:
        self.st, self.stash = st, stash
        self.slots_ptr = mem.pool(Tier.DEVICE).buffer.untyped_storage().data_ptr()

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() == self.slots_ptr:
            if self.st.plan.stream and not isinstance(t, torch.nn.Parameter):  # parameters are re-pointed
                storage, base = slot_base(self.st.slot)
                offset = t.storage_offset() * t.element_size() - base
                if 0 <= offset < self.st.slot.chunk.nbytes:
                    return _SlotView(self.st, offset, t)
            return t
        return self.stash.pack(t) if self.stash is not None else t

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _SlotView):
            return packed.restore()
        return HostStash.unpack(packed)


def wrap_forward(forward: Callable[..., Any], recompute: bool, hooks: SavedTensors | None) -> Callable[..., Any]:
    """The block's forward with its switches on (only while autograd records: inference is untouched)."""

    def switched(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if hooks is None:
            return ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            if recompute:
                return ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

    return switched
