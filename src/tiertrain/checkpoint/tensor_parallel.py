"""Checkpoints of a tensor-parallel run (``tiertrain.tensor_parallel``, issue 39).

``step-N/`` holds one sub-checkpoint per tensor-parallel rank, ``tp-RRR/``: what that rank's shards alone
write (its data-parallel ranks' shard files, or one process's model and optimizer files), beside a
trainer.json that names the group's size and a config.json of the whole model. A cut parameter keeps the
whole model's name with its shard's shape, so reading puts each tensor's shards back together by the rule
that cut them (``parallel.tensor_plans.split_of``) and cuts it again for the reader's group: the checkpoint
resumes at another tp, at any dp, and in one process of plain PyTorch. A reader at the saved tp reads its
own sub-checkpoint alone. Nothing is gathered on one rank while saving. A checkpoint saved whole (tp = 1:
one process, data parallel, a pipeline) is read by a cut run likewise, each tensor cut as it is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiertrain import typed
from tiertrain.checkpoint.pipelined import (
    check_covers,
    open_part,
    tp_dir,
    write_part,
    write_top,
)
from tiertrain.checkpoint.run import ManyRankSave, TrainerFile, TrainerState, is_stage
from tiertrain.checkpoint.train_state import TieredState, TrainState
from tiertrain.parallel.tensor_layers import tensor_rank
from tiertrain.parallel.tensor_plans import split_of
from tiertrain.tensor_file import TensorSpec


@dataclass(frozen=True)
class TensorRecord:
    """trainer.json's ``tensor``: the layout the run saved from."""

    tp: int = field(metadata=typed.between(1, 1 << 16))      # sub-checkpoints: tp-000 .. tp-(tp-1)
    ranks: int = field(metadata=typed.between(1, 1 << 20))   # the ranks the run trained on


def save_tensor_parallel(run: Any, out: str | Path, step: int, data_position: int = 0, keep: int = 2,
                         run_config: dict[str, Any] | None = None) -> Path:
    """Every rank together, between steps: a checkpoint of the tensor-parallel run ``run``
    (``tiertrain.tensor_parallel``'s) at ``step`` in ``out/checkpoints/``; it resumes with
    ``load_tensor_parallel`` at any tp and dp, or in one process (``train --resume``). The ``keep`` newest
    are kept."""
    return save_shards(Path(out), run.model, run.mesh, run.optimizer.param_groups,
                       TrainerState(step, data_position, {}, run_config or {}), keep)


def load_tensor_parallel(run: Any, path: str | Path) -> TrainerState:
    """Every rank together: ``run``'s shards from a checkpoint of any tp (a run directory's latest, or one
    checkpoint directory), or of one process; the step and data position it was saved at."""
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint

    return load_checkpoint(find_checkpoint(Path(path)), TieredState(run.model))


def save_shards(out: Path, model: nn.Module, mesh: Any, param_groups: list[dict[str, Any]],
                state: TrainerState, keep: int) -> Path:
    """Every rank calls it together, between steps: each writes its shards into its group rank's
    sub-checkpoint (with its shard's data-parallel ranks, sharded as a data-parallel run saves), rank 0
    adds the top level and publishes. A failure on any rank fails the save on all, the previous
    checkpoint intact."""
    save = ManyRankSave.begin(out, state.step, mesh.world, "tensor")
    write_part(save.tmp / tp_dir(mesh.tp_rank), TieredState(model), state, save.agree)
    subdirs = [tp_dir(r) for r in range(mesh.tp)]
    top = {"tensor": {"tp": mesh.tp, "ranks": mesh.world.world_size}}
    save.agree(lambda: write_top(save.tmp, model, subdirs, top, param_groups, state) if mesh.world.rank == 0 else None)
    return save.publish(keep)


class Resplit(Mapping):
    """The saved ranks' tensors by name (``parts``: by saved rank), each put back together and cut for the
    reader's rank of a group of ``size`` as it is read; a whole parameter, and a step, as any rank saved it
    (every rank holds it alike). Saved at the reader's size, only the reader's own part is opened."""

    def __init__(self, parts: dict[int, Mapping], saved: int, rank: int, size: int) -> None:
        self._parts, self._saved, self._rank, self._size = parts, saved, rank, size
        self._any = parts[min(parts)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._any)

    def __len__(self) -> int:
        return len(self._any)

    def __contains__(self, key: object) -> bool:
        return key in self._any

    def __getitem__(self, key: str) -> torch.Tensor:
        name, _, kind = key.partition("::")
        split = split_of(name)
        if split is None or kind == "step":
            return self._any[key]
        if self._saved == self._size:  # the rank's own shard as it was written
            return self._parts[self._rank][key]
        whole = split.merge([self._parts[r][key] for r in range(self._saved)])
        return whole if self._size == 1 else split.shard(whole, self._rank, self._size)

    def close(self) -> None:
        for part in self._parts.values():
            if hasattr(part, "close"):  # sharded files, a pipelined part's stages
                part.close()


def shard_tensors(ckpt: Path, trainer: TrainerFile, ts: TrainState) -> tuple[Resplit, Resplit]:
    """The weights and moments of the tensor-parallel checkpoint ``ckpt`` (its ``trainer.json`` as
    ``read_trainer`` checked it) as the reader's rank holds them, after every sub-checkpoint it reads is
    verified and every tensor the reader needs is found with its shape."""
    rec = TensorRecord(**trainer.tensor)
    rank, size = tensor_rank(ts.module)
    read = [rank] if rec.tp == size else range(rec.tp)
    needed = set(ts.expected_weights()) if is_stage(ts.module) else None  # a pipeline stage's own names
    opened = {r: open_part(ckpt / tp_dir(r), trainer.step, needed) for r in read}
    specs = {n: _resized(spec, rec.tp, size) for n, spec in opened[min(opened)][2].items()}
    check_covers(ckpt, specs, ts)
    return (Resplit({r: w for r, (w, _, _) in opened.items()}, rec.tp, rank, size),
            Resplit({r: o for r, (_, o, _) in opened.items()}, rec.tp, rank, size))


class WholeView:
    """A reader cut over tensor-parallel ranks seen as its whole model: what a checkpoint saved whole (one
    process, data parallel, a pipeline) is checked against, before each tensor is cut for the reader
    (``cut_for``). Everything else is the reader's own."""

    def __init__(self, ts: TrainState, size: int) -> None:
        self._ts, self._size = ts, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ts, name)

    def expected_weights(self) -> dict[str, TensorSpec]:
        return {n: _resized(s, self._size, 1) for n, s in self._ts.expected_weights().items()}

    def expected_moments(self) -> dict[str, TensorSpec]:
        return {n: _resized(s, self._size, 1) for n, s in self._ts.expected_moments().items()}


def whole_view(ts: TrainState) -> WholeView | None:
    """``ts`` as its whole model where it is cut over tensor-parallel ranks; None where it is whole."""
    size = tensor_rank(ts.module)[1]
    return WholeView(ts, size) if size > 1 else None


def cut_for(ts: TrainState, weights: Mapping, moments: Mapping) -> tuple[Resplit, Resplit]:
    """A whole checkpoint's weights and moments as the reader's rank of its tensor-parallel group holds them."""
    rank, size = tensor_rank(ts.module)
    return Resplit({0: weights}, 1, rank, size), Resplit({0: moments}, 1, rank, size)


def _resized(spec: TensorSpec, saved: int, size: int) -> TensorSpec:
    """A saved shard's spec as a rank of a group of ``size`` holds the tensor."""
    split = split_of(spec.name)
    if split is None or saved == size:
        return spec
    shape = list(spec.shape)
    shape[split.dim] = shape[split.dim] * saved // size
    return TensorSpec(spec.name, spec.dtype, tuple(shape))
