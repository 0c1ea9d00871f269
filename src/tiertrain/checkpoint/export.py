"""``tiertrain export``: a checkpoint, sharded over ranks or not, as one plain safetensors state dict
beside its config: for a transformers model a directory ``from_pretrained`` loads, for tiertrain's own
models one ``tiertrain.models.build`` and ``load_state_dict`` take. The weights are the fp32 masters
(the checkpoint's ``model.safetensors``, or each parameter cut out of the rank files it spans), read and
written a piece at a time: an export never holds more than ``PIECE_BYTES`` of them, whatever the model.

Only the files an export reads are verified (the config and the weights' files, their checksums, then
their headers); the optimizer's are not read. The directory appears whole or not at all (written beside
it, then renamed onto the empty one claimed at the start), and a directory with anything in it is never
written into or replaced.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tiertrain.checkpoint.atomic import fsync_path
from tiertrain.checkpoint.pieces import SUFFIX as PIECES
from tiertrain.checkpoint.run import (
    TrainerFile,
    checked_whole,
    find_checkpoint,
    read_json,
    read_trainer,
    verify_files,
)
from tiertrain.checkpoint.sharded import ShardedTensors, ShardMap, check_shard_files
from tiertrain.errors import CheckpointError, OutputError
from tiertrain.tensor_file import (
    PIECE_BYTES,
    LazyTensors,
    TensorSpec,
    TensorStream,
    write_streamed,
)
from tiertrain.units import format_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_F32 = torch.float32


@dataclass(frozen=True)
class Weights:
    """A checkpoint's weights by name, in the order they are written, each read as flat fp32 pieces."""

    shapes: dict[str, tuple[int, ...]]
    pieces: Callable[[str], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values()) * _F32.itemsize


def export_checkpoint(path: Path, out: Path, dtype: str = "fp32", say: Callable[[str], None] = print) -> Path:
    """Write the checkpoint at ``path`` (a checkpoint, or a run directory: its newest) into the new or
    empty directory ``out``; return the checkpoint read."""
    if dtype not in DTYPES:
        raise OutputError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    ckpt = find_checkpoint(path)
    weights = _weights(ckpt)
    config = _config(ckpt, DTYPES[dtype])
    made = _claim(out)
    say(f"exporting {len(weights.shapes)} tensors ({format_bytes(weights.nbytes)} in fp32) from {ckpt} as {dtype}")
    tmp, done = out.parent / f".{out.name}.export-{os.getpid()}", False
    try:
        tmp.mkdir(mode=0o755)
        _write(tmp, weights, DTYPES[dtype], say)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for child in (*tmp.iterdir(), tmp):
            fsync_path(child)
        os.rename(tmp, out)  # onto the empty directory claimed: it fails where anything was put there since
        done = True
    except OSError as exc:
        raise OutputError(_why(exc, out)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and not done:
            _remove_if_empty(out)
    say(f"exported to {out}: model.safetensors ({format_bytes((out / 'model.safetensors').stat().st_size)}), "
        "config.json")
    return ckpt


def _claim(out: Path) -> bool:
    """Make ``out`` (True), or take it as it is where it is an empty directory (False); never a
    directory with anything in it, a file, or a link."""
    try:
        out.mkdir()
        return True
    except FileExistsError:
        if out.is_symlink() or not out.is_dir() or any(out.iterdir()):
            raise OutputError(f"{out} exists and is not an empty directory; give a new directory with --out") from None
        return False
    except FileNotFoundError:
        raise OutputError(f"the directory {out.parent} that --out names does not exist; create it first") from None
    except OSError as exc:
        raise OutputError(f"cannot create {out} ({exc.strerror}); give a writable place with --out") from None


def _why(exc: OSError, out: Path) -> str:
    if exc.errno == errno.ENOSPC:
        return f"the disk under {out.parent} is full; free space there or give another --out (nothing was exported)"
    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
        return f"{out} was written into during the export; give a new directory with --out (nothing was exported)"
    return f"cannot write the export into {out.parent} ({exc.strerror}); nothing was exported"


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # something was put there meanwhile: not ours to remove


def _write(tmp: Path, weights: Weights, dtype: torch.dtype, say: Callable[[str], None]) -> None:
    """``model.safetensors``, a piece at a time, saying how far it is every 10 s of a long export."""
    done, said = [0], [time.monotonic()]

    def pieces() -> Iterator[torch.Tensor]:
        for name in weights.shapes:
            for piece in weights.pieces(name):
                done[0] += piece.numel() * _F32.itemsize
                if time.monotonic() - said[0] > 10:
                    say(f"  {format_bytes(done[0])} of {format_bytes(weights.nbytes)} read")
                    said[0] = time.monotonic()
                yield piece.to(dtype)

    specs = [TensorSpec(n, dtype, shape) for n, shape in weights.shapes.items()]
    write_streamed(tmp / "model.safetensors", TensorStream(specs, lambda: iter(()), pieces), {"format": "pt"})


def _weights(ckpt: Path) -> Weights:
    """The checkpoint's weights, its files verified first: a pipelined one's, every stage's together (a
    stage's parameters keep the model's names)."""
    trainer = read_trainer(ckpt)
    if trainer.pipeline is not None:
        from tiertrain.checkpoint.pipelined import PipelineRecord, stage_dir, tied_copy

        rec = PipelineRecord(**trainer.pipeline)  # read_trainer checked it
        parts = _parts(ckpt, trainer, [stage_dir(v) for v in range(rec.stages)])
        owner: dict[str, Weights] = {}
        for v, part in enumerate(parts):
            for name, shape in part.shapes.items():
                if name in owner and tied_copy(name, v, rec, owner[name].shapes[name] == shape):
                    continue  # a tied embedding's copy in the last stage: the first stage's is the weight
                if name in owner:
                    raise CheckpointError(f"{name} is saved by two stages of {ckpt}; the checkpoint is damaged")
                owner[name] = part
        return Weights({n: w.shapes[n] for n, w in owner.items()}, lambda name: owner[name].pieces(name))
    if trainer.tensor is not None:
        return _merged(ckpt, trainer)
    smap = ShardMap.read(trainer.shards, f"checkpoint file {ckpt / 'trainer.json'}: shards") if trainer.shards else None
    read = ("config.json", *(smap.files() if smap is not None else ["model.safetensors"]))
    listed = {k: v for k, v in trainer.files.items() if k in read or k.removesuffix(PIECES) in read}
    verify_files(ckpt, checked_whole(listed))  # read_trainer: all of them listed; rank files checked as read
    return _sharded(ckpt, smap) if smap is not None else _plain(ckpt)


def _parts(ckpt: Path, trainer: TrainerFile, subdirs: list[str]) -> list[Weights]:
    """The weights of a checkpoint's sub-checkpoints (a pipeline's stages, a tensor-parallel group's ranks),
    its top-level files verified first and each part checked to be of its step."""
    verify_files(ckpt, checked_whole(trainer.files))
    parts = []
    for sub in subdirs:
        if read_trainer(ckpt / sub).step != trainer.step:
            raise CheckpointError(f"{ckpt / sub} is of another step than its checkpoint; the checkpoint is damaged "
                                  "or was assembled by hand")
        parts.append(_weights(ckpt / sub))
    return parts


def _merged(ckpt: Path, trainer: TrainerFile) -> Weights:
    """A tensor-parallel checkpoint's weights: each cut tensor put back together from every rank's shard
    (one tensor whole in memory at a time), the whole ones from the first rank's."""
    from tiertrain.checkpoint.tensor_parallel import TensorRecord, tp_dir
    from tiertrain.parallel.tensor_plans import split_of

    rec = TensorRecord(**trainer.tensor)  # read_trainer checked it
    parts = _parts(ckpt, trainer, [tp_dir(r) for r in range(rec.tp)])
    shapes = {}
    for name, shape in parts[0].shapes.items():
        split = split_of(name)
        shapes[name] = shape if split is None else tuple(n * rec.tp if d == split.dim else n
                                                         for d, n in enumerate(shape))

    def pieces(name: str) -> Iterator[torch.Tensor]:
        split = split_of(name)
        if split is None:
            yield from parts[0].pieces(name)
            return
        shards = [torch.cat(list(part.pieces(name))).view(part.shapes[name]) for part in parts]
        yield split.merge(shards).reshape(-1)

    return Weights(shapes, pieces)


def _plain(ckpt: Path) -> Weights:
    """A one-process checkpoint's ``model.safetensors``: each tensor read a few rows at a time."""
    tensors = LazyTensors(ckpt / "model.safetensors")
    odd = next((n for n in tensors if tensors.dtype(n) != _F32), None)
    if odd is not None:
        raise CheckpointError(f"{ckpt / 'model.safetensors'} holds {odd!r} in {tensors.dtype(odd)}, not the fp32 "
                              "masters a checkpoint holds; it is damaged or not a tiertrain checkpoint")
    shapes = {n: tensors.shape(n) for n in tensors}

    def pieces(name: str) -> Iterator[torch.Tensor]:
        shape = shapes[name]
        if len(shape) == 0:
            yield tensors[name].reshape(-1)
            return
        rows = max(1, PIECE_BYTES // max(1, math.prod(shape[1:]) * _F32.itemsize))
        for lo in range(0, shape[0], rows):
            yield tensors.read_range(name, lo, min(shape[0], lo + rows)).reshape(-1)

    return Weights(shapes, pieces)


def _sharded(ckpt: Path, smap: ShardMap) -> Weights:
    """A data-parallel checkpoint's weights, each cut out of the rank files it spans, a piece at a time."""
    shapes = {n: tuple(shape) for b in smap.blocks for n, _, shape in b.params}
    check_shard_files(ckpt, smap, {n: TensorSpec(n, _F32, s) for n, s in shapes.items()})
    tensors = ShardedTensors(ckpt, smap, moments=False)
    step = PIECE_BYTES // _F32.itemsize

    def pieces(name: str) -> Iterator[torch.Tensor]:
        n = math.prod(shapes[name])
        for lo in range(0, n, step):
            yield tensors.read_range(name, lo, min(n, lo + step))

    return Weights(shapes, pieces)


def _config(ckpt: Path, dtype: torch.dtype) -> dict:
    """The checkpoint's model config, with the dtype the weights are written in (transformers reads
    ``torch_dtype``)."""
    config = read_json(ckpt / "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{ckpt / 'config.json'} does not describe a model (not a mapping); it is damaged")
    return {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
