"""A tiered run's weights and AdamW state as plain tensors, keyed like a plain run's.

Weights come from the fp32 master chunks (a streamed block's slot may hold another
block), optimizer state from the moment chunks and step counters. The names and keys
match ``model.state_dict()`` and the plain checkpoint's ``<param>::exp_avg``, so a plain
checkpoint resumes into a tiered run and back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from tiertrain.memory import Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.heap import release_free_heap
from tiertrain.runtime.block_group import F32, BlockGroup
from tiertrain.runtime.runtime import Runtime
from tiertrain.optim.hparams import MOMENTS
from tiertrain.tensor_file import TensorSpec, TensorStream



def _read(rt: Runtime, chunk: Chunk) -> torch.Tensor:
    if chunk.tier is Tier.DISK:
        return rt.mem.to_tensor(chunk).view(F32)
    return chunk.typed(F32).detach().cpu().clone()


def _split(st: BlockGroup, flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in st.layout.slots]


def _stepped(st: BlockGroup) -> list[int]:
    """Parameters that have AdamW state: plain AdamW has none for a parameter it never stepped."""
    return [i for i in range(len(st.params)) if float(st.steps[i]) > 0]


def weight_stream(rt: Runtime) -> TensorStream:
    """The fp32 masters, one block's chunk in memory at a time (read from disk where they live)."""
    rt.wait_updates()
    specs = [TensorSpec(n, F32, tuple(p.shape)) for st in rt.groups for n, p in st.block.params]

    def tensors() -> Iterator[torch.Tensor]:
        for st in rt.groups:
            release_free_heap()  # the last block's buffer, freed, would stay in the heap (memory.heap)
            yield from _split(st, _read(rt, st.master))
    return TensorStream(specs, tensors)


def optimizer_stream(rt: Runtime) -> TensorStream:
    """AdamW state keyed ``<param>::step|exp_avg|exp_avg_sq``, one block's moments in memory at a time."""
    rt.wait_updates()
    specs = [TensorSpec(f"{st.block.params[i][0]}::{k}", F32, () if k == "step" else tuple(st.params[i].shape))
             for st in rt.groups for i in _stepped(st) for k in ("step", *MOMENTS)]

    def tensors() -> Iterator[torch.Tensor]:
        for st in rt.groups:
            stepped = _stepped(st)
            if not stepped:
                continue
            release_free_heap()
            moments = [_split(st, _read(rt, getattr(st, k))) for k in MOMENTS]
            for i in stepped:
                yield st.steps[i].detach().clone()
                yield from (m[i] for m in moments)
            del moments
    return TensorStream(specs, tensors)


def export_state(rt: Runtime) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Both streams as dicts of tensors of their own (for a model that fits in memory)."""
    return tuple({s.name: t.clone() for s, t in zip(stream.specs, stream.tensors())}
                 for stream in (weight_stream(rt), optimizer_stream(rt)))  # type: ignore[return-value]


def _flat(st: BlockGroup, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """The block's chunk contents in layout order (zeros where a tensor is missing, and in the padding)."""
    flat = torch.zeros(st.layout.numel, dtype=F32)
    for s, t in zip(st.layout.slots, tensors):
        if t is not None:
            flat[s.offset : s.offset + s.numel] = t.reshape(-1)
    return flat


def _write(rt: Runtime, chunk: Chunk, flat: torch.Tensor, dtype: torch.dtype = F32) -> None:
    data = flat.to(dtype)
    if data.numel() * dtype.itemsize == chunk.nbytes:
        rt.mem.overwrite(chunk, data)  # where it lies: a disk chunk is written, never read first
        return
    home = chunk.tier  # a chunk longer than its layout keeps its other bytes
    if home is Tier.DISK:
        rt.mem.move(chunk, Tier.HOST, contiguous=True).wait()
    chunk.typed(dtype)[: flat.numel()].copy_(data)
    if home is Tier.DISK:
        rt.mem.move(chunk, Tier.DISK).wait()


def import_state(rt: Runtime, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]) -> None:
    """Write saved tensors into the block chunks, block by block (``LazyTensors`` reads each only
    when its block is written, so a model larger than memory resumes)."""
    rt.wait_updates()
    rt.cache.settle()
    for st in rt.groups:
        names = [n for n, _ in st.block.params]
        master = _flat(st, [weights[n] for n in names])
        _write(rt, st.master, master)
        target = st.param_home if st.param_home is not None else st.slot.chunk
        _write(rt, target, master, F32 if target is st.master else st.compute)
        for k in MOMENTS:
            _write(rt, getattr(st, k), _flat(st, [optim.get(f"{n}::{k}") for n in names]))
        for i, n in enumerate(names):
            st.steps[i].copy_(optim.get(f"{n}::step", torch.zeros((), dtype=F32)))
        rt.cache.invalidate(st)
        st.release()  # gradients gathered before the load belong to no step now
        release_free_heap()
