"""A tiered run's weights and AdamW state as plain tensors, keyed like a plain run's.

Weights come from the fp32 master chunks (a streamed block's slot may hold another
block), optimizer state from the moment chunks and step counters. The names and keys
match ``model.state_dict()`` and the plain checkpoint's ``<param>::exp_avg``, so a plain
checkpoint resumes into a tiered run and back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from tiertrain.memory import Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.heap import release_free_heap
from tiertrain.optim.hparams import MOMENTS
from tiertrain.plan.bytes import in_pieces
from tiertrain.runtime.block_group import F32, BlockGroup
from tiertrain.runtime.runtime import Runtime
from tiertrain.tensor_file import PIECE_BYTES, TensorSpec, TensorStream




def _read(rt: Runtime, chunk: Chunk) -> torch.Tensor:
    """A chunk's fp32 values, as a CPU tensor of their own (a disk chunk read and verified)."""
    if chunk.tier is Tier.DISK:
        return rt.mem.to_tensor(chunk).view(F32)
    return chunk.typed(F32).detach().cpu().clone()


def read_state(rt: Runtime, g: BlockGroup, chunk: Chunk) -> torch.Tensor:
    """This rank's part of a state chunk (its shard, or the whole block), flat fp32 on the CPU."""
    return _read(rt, chunk)[: g.state_numel]


def _whole(rt: Runtime, g: BlockGroup, chunk: Chunk) -> torch.Tensor:
    """A state chunk's values for the whole block: a sharded block's gathered from every rank (all ranks
    must ask together)."""
    mine = read_state(rt, g, chunk)
    if g.shard is None:
        return mine
    whole = torch.empty(g.layout.numel, dtype=F32)
    g.comm.host.all_gather(whole, mine)  # host copies: a checkpoint's values
    return whole


def logical_steps(g: BlockGroup) -> torch.Tensor:
    """Each parameter's AdamW step count: a sharded block's ranks step only the pieces they hold, so the
    count is the most any rank has (all ranks must ask together)."""
    steps = torch.stack([s.detach().float().cpu() for s in g.steps]) if g.steps else torch.zeros(0)  # GPU-homed too
    if g.shard is not None:
        g.comm.host.all_reduce(steps, op="max")
    return steps


def _split(st: BlockGroup, flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in st.layout.slots]


def _stepped(st: BlockGroup) -> list[int]:
    """Parameters that have AdamW state: plain AdamW has none for a parameter it never stepped."""
    return [i for i in range(len(st.params)) if float(st.steps[i]) > 0]


# what a stream writes: a tensor as it is, or parameter i's values in a group's state chunk
_Item = torch.Tensor | tuple[BlockGroup, Chunk, int]


def weight_stream(rt: Runtime) -> TensorStream:
    """The fp32 masters, one parameter in memory at a time (read from disk where they live)."""
    rt.wait_updates()
    specs = [TensorSpec(n, F32, tuple(p.shape)) for st in rt.groups for n, p in st.block.params]

    def items() -> Iterator[_Item]:
        for st in rt.groups:
            release_free_heap()  # the last block's buffer, freed, would stay in the heap (memory.heap)
            yield from ((st, st.master, i) for i in range(len(st.layout.slots)))
    return _stream(rt, specs, items)


def _stream(rt: Runtime, specs: list[TensorSpec], items: Callable[[], Iterator[_Item]]) -> TensorStream:
    """``items`` as whole tensors (``TensorStream.tensors``) and in pieces (what a checkpoint writes)."""
    def tensors() -> Iterator[torch.Tensor]:
        for it in items():
            yield it if isinstance(it, torch.Tensor) else _param_of(rt, *it)

    def pieces() -> Iterator[torch.Tensor]:
        for it in items():
            if isinstance(it, torch.Tensor):
                yield it
            else:
                yield from _param_pieces(rt, *it)
    return TensorStream(specs, tensors, pieces)


def _param_of(rt: Runtime, st: BlockGroup, chunk: Chunk, i: int) -> torch.Tensor:
    """Parameter ``i``'s values in a state chunk, a tensor of its own, read or copied alone, never the
    whole chunk: a checkpoint holds one parameter's state beside the budgets, not a block's (the 354M's
    embeddings and head are 210 MB a state; both moments of them read whole raised its RSS by 230 MB
    while it saved)."""
    s = st.layout.slots[i]
    return _values(rt, chunk, s.offset, s.numel).view(s.shape)


def _param_pieces(rt: Runtime, st: BlockGroup, chunk: Chunk, i: int) -> Iterator[torch.Tensor]:
    """Parameter ``i``'s values in a state chunk, as ``_param_of`` gives them, in pieces of at most
    ``PIECE_BYTES``: one piece in memory at a time (flat fp32)."""
    s = st.layout.slots[i]
    step = PIECE_BYTES // F32.itemsize
    for lo in range(0, s.numel, step):
        yield _values(rt, chunk, s.offset + lo, min(step, s.numel - lo))


def _values(rt: Runtime, chunk: Chunk, offset: int, numel: int) -> torch.Tensor:
    """Elements ``[offset, offset + numel)`` of a state chunk, flat fp32 on the CPU, of their own."""
    if chunk.tier is Tier.DISK:
        return rt.mem.read_range(chunk, offset * F32.itemsize, numel * F32.itemsize).view(F32)
    return chunk.typed(F32)[offset : offset + numel].detach().cpu().clone()


def optimizer_stream(rt: Runtime) -> TensorStream:
    """AdamW state keyed ``<param>::step|exp_avg|exp_avg_sq``, one parameter's moment in memory at a time."""
    rt.wait_updates()
    specs = [TensorSpec(f"{st.block.params[i][0]}::{k}", F32, () if k == "step" else tuple(st.params[i].shape))
             for st in rt.groups for i in _stepped(st) for k in ("step", *MOMENTS)]

    def items() -> Iterator[_Item]:
        for st in rt.groups:
            release_free_heap()
            for i in _stepped(st):
                yield st.steps[i].detach().clone()
                yield from ((st, getattr(st, k), i) for k in MOMENTS)  # one read at a time
    return _stream(rt, specs, items)


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


def _weights_of(rt: Runtime, g: BlockGroup) -> torch.Tensor:
    """A block's current weights, flat fp32 on the CPU: its master (gathered, where sharded), or
    (forward-only runs) the compute copy its slot is filled from."""
    if g.master is not None:
        return _whole(rt, g, g.master)
    chunk = g.param_home if g.param_home is not None else g.slot.chunk
    return chunk.typed(g.compute)[: g.layout.numel].detach().to(F32).cpu()


def current_weights(rt: Runtime) -> Iterator[tuple[BlockGroup, list[torch.Tensor]]]:
    """Each block's current weights (after any update in flight), one block in memory at a time."""
    rt.wait_updates()
    for g in rt.groups:
        release_free_heap()
        yield g, _split(g, _weights_of(rt, g))


def write_weights(rt: Runtime, g: BlockGroup, tensors: list[torch.Tensor | None]) -> None:
    """New weights for a block (None: keep the parameter's current value): its master and the compute
    copy its next forward reads; its moments are left as they are. A sharded block keeps its shard."""
    if _by_parts(g) and all(t is not None for t in tensors):
        _write_parts(rt, g, g.master, tensors)
        target = g.param_home if g.param_home is not None else g.slot.chunk
        if target is not g.master:
            _write_parts(rt, g, target, tensors, g.compute)
        g.params_written()
        return
    if any(t is None for t in tensors):
        current = _split(g, _weights_of(rt, g))
        tensors = [c if t is None else t for c, t in zip(current, tensors)]
    whole = _flat(g, tensors)
    mine = whole if g.shard is None else whole[g.shard[0] : g.shard[1]]
    if g.master is not None:
        _write(rt, g.master, mine)
    target = g.param_home if g.param_home is not None else g.slot.chunk
    if target is not g.master:
        _write(rt, target, mine if target is g.param_home else whole, g.compute)
    if g.shard is not None and not g.plan.stream:
        _write(rt, g.slot.chunk, whole, g.compute)  # a resident sharded block's slot holds the whole block
    g.params_written()  # a streamed block's slot copy is refilled at its next use


def write_moments(rt: Runtime, g: BlockGroup, state: Mapping[str, torch.Tensor], names: list[str]) -> None:
    """A block's AdamW moments and step counts from ``state`` keyed ``<name>::<kind>`` (missing: zero,
    as a parameter AdamW never stepped has none); a sharded block keeps its shard of the moments."""
    for k in MOMENTS:
        given = [state.get(f"{n}::{k}") for n in names]
        if _by_parts(g):
            _write_parts(rt, g, getattr(g, k), given)
            continue
        whole = _flat(g, given)
        _write(rt, getattr(g, k), whole if g.shard is None else whole[g.shard[0] : g.shard[1]])
    for i, n in enumerate(names):
        g.steps[i].copy_(state.get(f"{n}::step", torch.zeros((), dtype=F32)))


def _by_parts(g: BlockGroup) -> bool:
    """Whether a block's saved states go to disk a parameter at a time (one updated in pieces, on one
    rank: its states may be several times the host, so no whole-block tensor of them is made)."""
    return in_pieces(g.plan) and g.shard is None and g.master is not None and g.exp_avg.tier is Tier.DISK


def _write_parts(rt: Runtime, g: BlockGroup, chunk: Chunk, tensors: list[torch.Tensor | None],
                 dtype: torch.dtype = F32) -> None:
    """A chunk of the block's (a state, or its compute copy in ``dtype``) from its parameters' tensors,
    each read (from a lazy checkpoint) only as its pages are written, or copied in where the chunk is in
    memory; a missing one (and the padding) zero."""
    rt.mem.write_parts(chunk, ((s.offset * dtype.itemsize, t.reshape(-1).to(dtype))
                               for s, t in zip(g.layout.slots, tensors) if t is not None))


def _shard_of(g: BlockGroup, source: Mapping[str, torch.Tensor], key: Callable[[str], str]) -> torch.Tensor:
    """This rank's elements of a sharded block's flat chunk, read from ``source`` by ranges of the
    parameters its shard spans (``ShardedTensors.read_range``, whose ``flat_ranges`` says it reads a
    parameter's flattened elements): nothing outside the shard is read; what
    no parameter covers (padding, a moment never saved) is zero."""
    lo, hi = g.shard
    out = torch.zeros(hi - lo, dtype=F32)
    for (name, _), s in zip(g.block.params, g.layout.slots):
        a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < z and key(name) in source:
            out[a - lo : z - lo] = source.read_range(key(name), a - s.offset, z - s.offset)  # type: ignore[attr-defined]
    return out


def _import_shard(rt: Runtime, g: BlockGroup, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor],
                  names: list[str]) -> None:
    """A sharded block's master, moments and step counts from a sharded checkpoint, its shard alone; its
    compute params gather from the shards at their next use (``BlockGroup.shard_written``)."""
    mine = _shard_of(g, weights, str)
    _write(rt, g.master, mine)
    if g.param_home is not None and g.param_home is not g.master:
        _write(rt, g.param_home, mine, g.compute)
    g.shard_written()
    for k in MOMENTS:
        _write(rt, getattr(g, k), _shard_of(g, optim, lambda n: f"{n}::{k}"))  # noqa: B023 - used at once
    for i, n in enumerate(names):
        g.steps[i].copy_(optim.get(f"{n}::step", torch.zeros((), dtype=F32)))


def import_state(rt: Runtime, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]) -> None:
    """Write saved tensors into the block chunks, block by block (``LazyTensors`` reads each only
    when its block is written, so a model larger than memory resumes)."""
    rt.wait_updates()
    rt.cache.settle()
    for g in rt.groups:
        names = [n for n, _ in g.block.params]
        if g.shard is not None and getattr(weights, "flat_ranges", False) and g.master is not None:
            _import_shard(rt, g, weights, optim, names)  # a sharded checkpoint: this rank's part alone is read
        else:
            write_weights(rt, g, [weights[n] for n in names])
            write_moments(rt, g, optim, names)
        g.release()  # gradients gathered before the load belong to no step now
        release_free_heap()
