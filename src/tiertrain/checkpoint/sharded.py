"""Checkpoints of a data-parallel run: every rank writes its own shards, nothing is gathered on one
rank, and the checkpoint loads at any world size (it is resharded as it is read).

Each rank writes ``shard-RRRRR-of-WWWWW.safetensors``: per block, its shard of the flat master and
moments (``<block>::master`` ...); rank 0 adds the blocks every rank holds whole (replicated ones) and
each block's per-parameter step counts (``<block>::steps``). ``trainer.json`` records, per block, the
parameters' places in its flat chunk (``ShardMap``), so a reader of any world size cuts each
parameter out of the shards it spans, one parameter at a time: the same named tensors
(``<param>``, ``<param>::exp_avg`` ...) a one-process checkpoint holds, so the rest of loading is
the same. Why not ``torch.distributed.checkpoint``: its metadata file is a pickle, and tiertrain
never unpickles what it reads.

Expert parallel: the experts rank ``j < ep`` holds (its replicas hold the same) are a block held whole
in rank ``j``'s file, with their own step counts (an expert steps only where a token reached it); the
map names each expert by its index among all of a layer's experts, so a checkpoint loads at any
``ep`` as at any world size.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiertrain import typed
from tiertrain.checkpoint.pieces import SUFFIX, CheckedRanges, piece_size, write_pieces
from tiertrain.errors import CheckpointError
from tiertrain.optim.hparams import MOMENTS
from tiertrain.tensor_file import LazyTensors, PieceCrcs, TensorSpec, TensorStream, streamed_bytes, write_streamed
from tiertrain.typed import at_least

F32 = torch.float32
KINDS = ("master", *MOMENTS)
SHARD_FILE = re.compile(r"shard-([0-9]{5})-of-([0-9]{5})\.safetensors")


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


@dataclass(frozen=True)
class BlockMap:
    """Where a block's parameters sit in its flat chunk, and how the chunk was split."""

    name: str
    numel: int = field(metadata=at_least(0))   # padded length of the flat chunk
    sharded: bool
    params: tuple[tuple[str, int, tuple[int, ...]], ...]  # (name, offset, shape), in chunk order
    rank: int = field(default=0, metadata=at_least(0))    # a whole block's: the rank file holding it
    index: int = field(default=-1, metadata=at_least(-1))  # its key in the rank files (-1, older maps: its place)

    def key(self, place: int) -> int:
        return place if self.index < 0 else self.index


@dataclass(frozen=True)
class ShardMap:
    world: int = field(metadata=at_least(2))  # rank files (the ranks a sharded block was split over)
    blocks: tuple[BlockMap, ...]
    ranks: int = field(default=0, metadata=at_least(0))  # the ranks the run trained on (0, older maps: ``world``)

    @property
    def run_ranks(self) -> int:
        return self.ranks or self.world

    @classmethod
    def read(cls, data: Any, where: str) -> ShardMap:
        found = typed.load(cls, data, where, error=CheckpointError)
        for b in found.blocks:
            if b.rank >= found.world:
                raise CheckpointError(f"{where}: block {b.name} is in rank file {b.rank} of {found.world}; "
                                      "the checkpoint is damaged")
            if b.sharded and b.numel % found.world:
                raise CheckpointError(f"{where}: block {b.name} of {b.numel} elements does not split over "
                                      f"{found.world} ranks; the checkpoint is damaged")
            for name, offset, shape in b.params:
                if offset < 0 or offset + _numel(shape) > b.numel:
                    raise CheckpointError(f"{where}: {name} lies outside its block's chunk; the checkpoint is damaged")
        return found

    def files(self) -> list[str]:
        return [shard_file(r, self.world) for r in range(self.world)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_map(rt: Any) -> ShardMap:
    """Rank 0's map of every rank's file: its own groups, and for each of its held-experts groups the
    same group as each expert-holding rank has it (the same layout, the experts renamed)."""
    held = {id(g.experts) for g in rt.groups if g.experts is not None}
    blocks = []
    for i, g in enumerate(rt.groups):
        b = BlockMap(g.block.name, g.layout.numel, g.shard is not None,
                     tuple((n, s.offset, tuple(s.shape)) for (n, _), s in zip(g.block.params, g.layout.slots)),
                     index=i)  # its key in the rank files: its group's index (a map may list a group per holder)
        if id(g) not in held:
            blocks.append(b)
            continue
        per = rt.experts.n_experts // rt.experts.ep
        blocks += [dataclasses.replace(b, name=f"{b.name}@{j}", rank=j,
                                       params=tuple((_expert_of(n, j * per), o, sh) for n, o, sh in b.params))
                   for j in range(rt.experts.ep)]
    files = rank_files(rt)
    return ShardMap(files, tuple(blocks), rt.comm.world_size if files != rt.comm.world_size else 0)


def rank_files(rt: Any) -> int:
    """Files a checkpoint of the run is written in: one per shard, written by ranks 0 .. n-1 (with hybrid
    sharding the first group: the others hold the same shards)."""
    return rt.shards.world_size


_EXPERT = re.compile(r"\.experts\.([0-9]+)\.")


def _expert_of(name: str, shift: int) -> str:
    """Rank 0's held expert parameter ``name`` as another expert-holding rank has it: rank 0 holds the
    first ``per`` of each layer's experts, rank ``j`` the ``j``-th ``per`` (``shift`` = j x per)."""
    return _EXPERT.sub(lambda m: f".experts.{int(m.group(1)) + shift}.", name, count=1)


def experts_held_elsewhere(smap: ShardMap, expected: Mapping[str, TensorSpec]) -> frozenset[str]:
    """The mapped expert parameters an expert-parallel rank does not hold (other ranks' experts)."""
    return frozenset(n for b in smap.blocks for n, _, _ in b.params if n not in expected and _EXPERT.search(n))


def agreed_steps(rt: Any) -> list[torch.Tensor]:
    """Every group's per-parameter step counts, agreed over the ranks (collective: every rank calls it
    together, before any rank writes, so that a rank whose write fails leaves no other in a collective)."""
    from tiertrain.runtime.state_io import logical_steps

    rt.wait_updates()
    return [logical_steps(g) for g in rt.groups]


def write_rank_file(tmp: Path, rt: Any, agreed: list[torch.Tensor]) -> int:
    """This rank's file (its shards; rank 0 also the whole blocks and the step counts, ``agreed_steps``);
    its CRC-32C. Local: no collective."""
    from tiertrain.memory.heap import release_free_heap
    from tiertrain.runtime.state_io import read_state

    rank, world = rt.comm.rank, rank_files(rt)
    if rank >= world:  # a replica of the first group's shards (hybrid sharding): they write them
        return 0
    held = {id(g.experts) for g in rt.groups if g.experts is not None}
    specs, parts = [], []
    for i, (g, steps) in enumerate(zip(rt.groups, agreed)):
        mine = rank < rt.experts.ep if id(g) in held else rank == 0  # whole blocks: one file holds each
        if g.shard is None and not mine:
            continue
        for kind in KINDS:
            specs.append(TensorSpec(f"{i}::{kind}", F32, (g.state_numel,)))
            parts.append((g, kind))
        if mine:
            specs.append(TensorSpec(f"{i}::steps", F32, (len(g.params),)))
            parts.append((g, steps))

    def tensors() -> Iterator[torch.Tensor]:
        for g, what in parts:
            release_free_heap()  # the last block's buffer, freed, would stay in the heap (memory.heap)
            yield what if isinstance(what, torch.Tensor) else read_state(rt, g, getattr(g, what))

    path, stream = tmp / shard_file(rank, world), TensorStream(specs, tensors)
    pieces = PieceCrcs(piece_size(streamed_bytes(stream)))
    crc = write_streamed(path, stream, pieces=pieces)
    write_pieces(path, pieces)
    return crc


class ShardedTensors(Mapping):
    """A sharded checkpoint's tensors by the names a one-process checkpoint gives them (``<param>`` for
    the weights, ``<param>::exp_avg|exp_avg_sq|step`` for the moments), each cut out of the rank files
    it spans when it is read. ``read_range`` reads a parameter's flattened elements (``flat_ranges``):
    a sharded run reads its shards alone so (``runtime.state_io``)."""

    flat_ranges = True

    def __init__(self, ckpt: Path, smap: ShardMap, moments: bool,
                 files: dict[int, CheckedRanges | LazyTensors] | None = None) -> None:
        """``files``: the rank files another view of the same checkpoint opened (each piece checked once)."""
        self.smap, self.moments, self.ckpt = smap, moments, ckpt
        self._files: dict[int, CheckedRanges | LazyTensors] = {} if files is None else files
        self.places: dict[str, tuple[int, BlockMap, int, tuple[int, ...], int]] = {}
        for place, b in enumerate(smap.blocks):
            for p_index, (name, offset, shape) in enumerate(b.params):
                for kind in (("exp_avg", "exp_avg_sq", "step") if moments else ("master",)):
                    key = name if kind == "master" else f"{name}::{kind}"
                    self.places[key] = (b.key(place), b, offset, tuple(shape), p_index)

    def moments_too(self) -> ShardedTensors:
        """The same checkpoint's moments, reading through the same opened files."""
        return ShardedTensors(self.ckpt, self.smap, True, self._files)

    def close(self) -> None:
        """Close the rank files opened (this view's and those it shares)."""
        for f in self._files.values():
            if isinstance(f, CheckedRanges):
                f.close()

    def file(self, rank: int) -> CheckedRanges | LazyTensors:
        """Rank file ``rank``, opened at its first read: read by ranges, each piece checked as it is first
        read (``checkpoint.pieces``), or where it has no piece checksums (an older checkpoint, verified
        whole before loading), through safetensors."""
        if rank not in self._files:
            path = self.ckpt / self.smap.files()[rank]
            has_pieces = path.with_name(path.name + SUFFIX).exists()
            self._files[rank] = CheckedRanges(path) if has_pieces else LazyTensors(path)
        return self._files[rank]

    def __contains__(self, key: object) -> bool:  # without reading the tensor, as Mapping's default would
        return key in self.places

    def __iter__(self) -> Iterator[str]:
        return iter(self.places)

    def __len__(self) -> int:
        return len(self.places)

    def __getitem__(self, key: str) -> torch.Tensor:
        b_index, b, _, shape, p_index = self.places[key]
        if key.endswith("::step"):
            return self.file(b.rank).read_range(f"{b_index}::steps", p_index, p_index + 1).reshape(())
        return self.read_range(key, 0, _numel(shape)).view(shape)

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of weight or moment ``key``, flattened, read from the rank files they span
        (``tiertrain export`` reads a large parameter in pieces so)."""
        b_index, b, offset, _, _ = self.places[key]
        kind, lo, hi = key.partition("::")[2] or "master", offset + lo, offset + hi
        if not b.sharded:
            return self.file(b.rank).read_range(f"{b_index}::{kind}", lo, hi)
        size, pieces = b.numel // self.smap.world, []
        for r in range(lo // size, (hi - 1) // size + 1 if hi > lo else lo // size):
            a, z = max(lo, r * size), min(hi, (r + 1) * size)
            pieces.append(self.file(r).read_range(f"{b_index}::{kind}", a - r * size, z - r * size))
        return torch.cat(pieces) if pieces else torch.zeros(0)


def check_shard_files(ckpt: Path, smap: ShardMap, expected: Mapping[str, TensorSpec],
                      others: frozenset[str] = frozenset()) -> None:
    """The map describes this model (names and shapes; ``others``: parameters of the model that this
    rank does not hold, other ranks' experts) and every rank file holds exactly the tensors the map
    says, in fp32 and of the sizes it says, checked from the headers before anything is read."""
    mapped = {n: tuple(shape) for b in smap.blocks for n, _, shape in b.params}
    if (mapped.keys() - others != expected.keys() or not others <= mapped.keys()
            or any(mapped[n] != tuple(expected[n].shape) for n in expected)):
        raise CheckpointError(f"the shards in {ckpt} are of other parameters than this model's; resume the model "
                              "they came from")
    for r, name in enumerate(smap.files()):
        file = LazyTensors(ckpt / name)
        want = {}
        for i, b in enumerate(smap.blocks):
            if b.sharded or r == b.rank:
                size = b.numel // smap.world if b.sharded else b.numel
                want.update({f"{b.key(i)}::{kind}": (size,) for kind in KINDS})
            if r == b.rank:
                want[f"{b.key(i)}::steps"] = (len(b.params),)
        if set(file) != set(want) or any(file.shape(k) != want[k] or file.dtype(k) != F32 for k in want):
            raise CheckpointError(f"{ckpt / name} does not hold this checkpoint's shards; it is damaged: "
                                  "resume from another checkpoint")
