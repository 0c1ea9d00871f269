"""A tiered run's weights and AdamW state as plain tensors, keyed like a plain run's.

Weights come from the fp32 master chunks (a streamed block's slot may hold another
block), optimizer state from the moment chunks and step counters. The names and keys
match ``model.state_dict()`` and the plain checkpoint's ``<param>::exp_avg``, so a plain
checkpoint resumes into a tiered run and back.
"""

from __future__ import annotations

import torch

from tiertrain.memory import Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.runtime.block_state import F32, BlockState
from tiertrain.runtime.runtime import Runtime

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _read(rt: Runtime, chunk: Chunk) -> torch.Tensor:
    if chunk.tier is Tier.DISK:
        return rt.mem.to_tensor(chunk).view(F32)
    return chunk.typed(F32).detach().cpu().clone()


def _split(st: BlockState, flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in st.layout.slots]


def export_state(rt: Runtime) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rt.wait_updates()
    weights, optim = {}, {}
    for st in rt.states:
        names = [n for n, _ in st.block.params]
        master = _split(st, _read(rt, st.master))
        moments = {k: _split(st, _read(rt, getattr(st, k))) for k in _MOMENTS}
        for i, name in enumerate(names):
            weights[name] = master[i]
            if float(st.steps[i]) > 0:  # plain AdamW has no state for a parameter it never stepped
                optim[f"{name}::step"] = st.steps[i].clone()
                for k in _MOMENTS:
                    optim[f"{name}::{k}"] = moments[k][i]
    return weights, optim


def _flat(st: BlockState, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """The block's chunk contents in layout order (zeros where a tensor is missing, and in the padding)."""
    flat = torch.zeros(st.layout.numel, dtype=F32)
    for s, t in zip(st.layout.slots, tensors):
        if t is not None:
            flat[s.offset : s.offset + s.numel] = t.reshape(-1)
    return flat


def _write(rt: Runtime, chunk: Chunk, flat: torch.Tensor, dtype: torch.dtype = F32) -> None:
    home = chunk.tier
    if home is Tier.DISK:
        rt.mem.move(chunk, Tier.HOST, contiguous=True).wait()
    chunk.typed(dtype)[: flat.numel()].copy_(flat)
    if home is Tier.DISK:
        rt.mem.move(chunk, Tier.DISK).wait()


def import_state(rt: Runtime, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> None:
    rt.wait_updates()
    rt.cache.settle()
    for st in rt.states:
        names = [n for n, _ in st.block.params]
        master = _flat(st, [weights[n] for n in names])
        _write(rt, st.master, master)
        target = st.param_home if st.param_home is not None else st.slot.chunk
        _write(rt, target, master, F32 if target is st.master else st.compute)
        for k in _MOMENTS:
            _write(rt, getattr(st, k), _flat(st, [optim.get(f"{n}::{k}") for n in names]))
        for i, n in enumerate(names):
            st.steps[i].copy_(optim.get(f"{n}::step", torch.zeros((), dtype=F32)))
        rt.cache.invalidate(st)
        st.has_grad = [False] * len(st.params)
