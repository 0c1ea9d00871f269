"""Checkpoints of a pipelined run (``tiertrain.pipeline``, issue 38).

``step-N/`` holds one sub-checkpoint per pipeline stage, ``stage-VVV/``: what a run of that stage alone
writes (its data-parallel ranks' shard files, or one process's model and optimizer files, each with its
own manifest and trainer.json), beside a trainer.json that names the stages and a config.json of the whole
model. A stage's parameters keep the model's names (``models.gpt_stages``), so the union of the stages'
tensors is the whole model's, by the names a one-process checkpoint gives them: the checkpoint resumes in
one process (``train --resume``, ``load_checkpoint``), at any data-parallel width, and at another pp (each
stage reads its own names out of the union). Nothing is gathered on one rank while saving. Stages cut over
tensor-parallel ranks (pp x tp) are saved as a tensor-parallel checkpoint whose every ``tp-RRR/`` is a
pipelined one of that rank's shards (``tp-RRR/stage-VVV/``): resumed at another tp as the shards are.
Why not ``torch.distributed.checkpoint``: as for data-parallel checkpoints, its metadata is a pickle.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tiertrain import typed
from tiertrain.checkpoint.run import (
    FORMAT_VERSION,
    ManyRankSave,
    TrainerFile,
    TrainerState,
    UnsharedDirectory,
    checked_whole,
    file_digest,
    is_stage,
    model_config_dict,
    read_trainer,
    rng_state,
    verify_files,
    write_files,
    write_sharded,
    write_stamp,
)
from tiertrain.checkpoint.sharded import ShardedTensors, ShardMap, check_shard_files
from tiertrain.checkpoint.train_state import TieredState, TrainState, plain_hparams
from tiertrain.errors import CheckpointError
from tiertrain.models.stages import TIED_NAMES
from tiertrain.optim.hparams import MOMENTS
from tiertrain.parallel.tensor_layers import tensor_rank
from tiertrain.tensor_file import LazyTensors, TensorSpec

F32 = torch.float32


def stage_dir(index: int) -> str:
    return f"stage-{index:03d}"


def tp_dir(rank: int) -> str:
    """A tensor-parallel rank's part of a checkpoint (``checkpoint.tensor_parallel``; here for pp x tp)."""
    return f"tp-{rank:03d}"


@dataclass(frozen=True)
class PipelineRecord:
    """trainer.json's ``pipeline``: the layout the run saved from."""

    pp: int = field(metadata=typed.between(1, 1 << 16))
    stages: int = field(metadata=typed.between(1, 1 << 16))   # sub-checkpoints: stage-000 .. stage-(stages-1)
    ranks: int = field(metadata=typed.between(1, 1 << 20))    # the ranks the run trained on


def save_pipelined(out: Path, parts: Sequence[tuple[int, nn.Module]], world: Any, record: PipelineRecord,
                   param_groups: list[dict[str, Any]], state: TrainerState, keep: int) -> Path:
    """Every rank calls it together: each writes its stages (``parts``: (stage index, tiered stage)) into the
    step's temporary directory (with its stage's data-parallel ranks, sharded as a data-parallel run
    saves; under its tensor-parallel rank's ``tp-RRR/`` where the stages are cut), rank 0 adds the top
    level and publishes. A failure on any rank fails the save on all of them (``agreement`` over
    ``world``), the temporary directory removed and the previous checkpoint intact."""
    save = ManyRankSave.begin(out, state.step, world, "pipeline")
    tp_rank, tp = tensor_rank(parts[0][1])  # every stage of a rank is cut over the same group
    base = save.tmp / tp_dir(tp_rank) if tp > 1 else save.tmp
    save.agree(lambda: base.mkdir(exist_ok=True))
    for index, module in parts:
        write_part(base / stage_dir(index), TieredState(module), state, save.agree)
    subdirs = [stage_dir(v) for v in range(record.stages)]
    stages = {"pipeline": {"pp": record.pp, "stages": record.stages, "ranks": record.ranks}}
    mine = world.rank == 0 if tp == 1 else world.rank < tp  # dp x pp x tp: tp-r's first rank is world rank r
    save.agree(lambda: write_top(base, parts[0][1], subdirs, stages, param_groups, state) if mine else None)
    if tp > 1:
        tps = [tp_dir(r) for r in range(tp)]
        top = {"tensor": {"tp": tp, "ranks": record.ranks}}
        save.agree(lambda: write_top(save.tmp, parts[0][1], tps, top, param_groups, state) if world.rank == 0 else None)
    return save.publish(keep)


def write_part(where: Path, ts: TieredState, state: TrainerState, agree: Any) -> None:
    """One sub-checkpoint (a stage's, a tensor-parallel rank's) as a run of that part alone writes it."""
    comm = ts.rt.comm
    agree(lambda: where.mkdir(exist_ok=True) if comm.rank == 0 else None)
    if comm.world_size > 1:
        write_sharded(where, ts, state, comm, agree)
        return
    agree(ts.rt.wait_updates)
    agree(lambda: write_files(where, ts, state))


def write_top(tmp: Path, module: nn.Module, subdirs: list[str], layout: dict[str, dict[str, int]],
              param_groups: list[dict[str, Any]], state: TrainerState) -> None:
    """The top level of a checkpoint of sub-checkpoints (``subdirs``, each written by its ranks): the whole
    model's config, rank 0's RNG, and a trainer.json with ``layout`` (its record of the parts)."""
    missing = [d for d in subdirs if not (tmp / d / "trainer.json").is_file()]
    if missing:
        raise UnsharedDirectory(errno.ENOENT, f"{', '.join(missing[:2])} written by the other ranks are not in {tmp} "
                                "as rank 0 sees it: every rank must save into one filesystem they share (--out on "
                                "NFS, Lustre...)")
    rng_tensors, rng_plain = rng_state()
    save_file(rng_tensors, tmp / "rng.safetensors")
    (tmp / "config.json").write_text(json.dumps(model_config_dict(module), indent=2))
    manifest = {name: file_digest(tmp / name) for name in ("config.json", "rng.safetensors")}
    trainer = {"format_version": FORMAT_VERSION, "step": state.step, "data_position": state.data_position,
               "scaler": state.scaler, "run_config": state.run_config, "rng": rng_plain,
               "param_groups": plain_hparams(param_groups), "files": manifest, "saved_at_ns": write_stamp(),
               **layout}
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))


class StagedTensors(Mapping):
    """The stages' tensors by name, each read from the stage that holds it when it is read."""

    def __init__(self, sources: dict[str, Mapping], opened: list[Mapping]) -> None:
        self._sources, self._opened = sources, opened
        self.flat_ranges = bool(opened) and all(getattr(m, "flat_ranges", False) for m in opened)

    def __contains__(self, key: object) -> bool:
        return key in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._sources[key][key]

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._sources[key].read_range(key, lo, hi)  # type: ignore[attr-defined]

    def close(self) -> None:
        for m in self._opened:
            if isinstance(m, ShardedTensors):
                m.close()


def stage_tensors(ckpt: Path, trainer: TrainerFile, ts: TrainState) -> tuple[StagedTensors, StagedTensors]:
    """The weights and moments of every stage of the pipelined checkpoint ``ckpt`` (its ``trainer.json`` as
    ``read_trainer`` checked it), as one mapping each, after every stage's files are verified and every
    tensor ``ts`` needs is found with its dtype and shape (a stage of another pipeline needs only its own;
    one process, all of them and no other)."""
    weights, moments, specs = open_stages(ckpt, trainer, set(ts.expected_weights()) if is_stage(ts.module) else None)
    check_covers(ckpt, specs, ts)
    return weights, moments


def open_stages(ckpt: Path, trainer: TrainerFile, needed: set[str] | None
                ) -> tuple[StagedTensors, StagedTensors, dict[str, TensorSpec]]:
    """Every stage of ``ckpt`` as one mapping of weights and one of moments, and the tensors' specs; a stage
    holding none of ``needed`` (None: all) only listed, its files not checksummed."""
    rec, step = PipelineRecord(**trainer.pipeline), trainer.step
    weights: dict[str, Mapping] = {}
    moments: dict[str, Mapping] = {}
    specs: dict[str, TensorSpec] = {}
    opened: list[Mapping] = []
    for v in range(rec.stages):
        w, o, found = open_part(ckpt / stage_dir(v), step, needed)
        opened.append(w)
        for name, spec in found.items():
            if name in specs and tied_copy(name, v, rec, spec == specs[name]):
                continue  # the last stage's copy of a tied weight: the first stage's is read (they are equal)
            if name in specs:
                raise CheckpointError(f"{name} is saved by two stages of {ckpt}; the checkpoint is damaged: resume "
                                      "from another checkpoint")
            specs[name] = spec
            weights[name] = w
            for kind in ("step", *MOMENTS):
                moments[f"{name}::{kind}"] = o
    return StagedTensors(weights, opened), StagedTensors(moments, opened), specs


def tied_copy(name: str, stage: int, rec: PipelineRecord, alike: bool) -> bool:
    """Whether ``name`` in ``stage``, already in an earlier stage (``alike``: with the same dtype and shape), is
    the last stage's copy of a tied embedding (``models.stages``): read from the first stage instead."""
    return name in TIED_NAMES and stage == rec.stages - 1 and alike


def open_part(where: Path, step: int, needed: set[str] | None) -> tuple[Mapping, Mapping, dict[str, TensorSpec]]:
    """A stage's tensors, its files verified before any is read, and their specs from the headers. ``needed``:
    the names a stage resuming needs (None: all); a sub-checkpoint holding none of them is only listed, its
    files not checksummed (a rank resuming its stages would read every stage's files whole otherwise). A
    part that is itself pipelined (a tensor-parallel rank's stages) is read as its stages together."""
    if not where.is_dir():
        raise CheckpointError(f"{where} is missing: a checkpoint of parts needs every part's folder; resume from "
                              "another checkpoint")
    trainer = read_trainer(where)
    if trainer.step != step:
        raise CheckpointError(f"{where} is of step {trainer.step}, its checkpoint of step {step}: the checkpoint is "
                              "damaged or was assembled by hand; resume from another checkpoint")
    if trainer.pipeline is not None:
        verify_files(where, checked_whole(trainer.files))
        return open_stages(where, trainer, needed)
    if trainer.shards is not None:
        smap = ShardMap.read(trainer.shards, f"checkpoint file {where / 'trainer.json'}: shards")
        specs = {n: TensorSpec(n, F32, tuple(shape)) for b in smap.blocks for n, _, shape in b.params}
        if needed is None or needed & specs.keys():
            verify_files(where, checked_whole(trainer.files))  # the rank files piece by piece as they are read
            check_shard_files(where, smap, specs)
        w = ShardedTensors(where, smap, moments=False)
        return w, w.moments_too(), specs
    w, o = LazyTensors(where / "model.safetensors"), LazyTensors(where / "optimizer.safetensors")
    specs = {n: TensorSpec(n, w.dtype(n), w.shape(n)) for n in w}
    if needed is None or needed & specs.keys():
        verify_files(where, checked_whole(trainer.files))
    for name, spec in specs.items():
        for kind in ("step", *MOMENTS):
            key, shape = f"{name}::{kind}", () if kind == "step" else spec.shape
            if key not in o or (o.dtype(key), o.shape(key)) != (F32, shape):
                raise CheckpointError(f"{where / 'optimizer.safetensors'} lacks {key} as fp32 {list(shape)}; the "
                                      "checkpoint is damaged: resume from another checkpoint")
    return w, o, specs


def check_covers(ckpt: Path, specs: dict[str, TensorSpec], ts: TrainState) -> None:
    expected = ts.expected_weights()
    missing = sorted(set(expected) - set(specs))
    extra = [] if is_stage(ts.module) else sorted(set(specs) - set(expected))
    wrong = [n for n in expected if n in specs and (specs[n].dtype, specs[n].shape) != (expected[n].dtype,
                                                                                        expected[n].shape)]
    if missing or extra or wrong:
        what = (f"{missing[0]} is in none of its stages" if missing else f"{extra[0]} is not this model's" if extra
                else f"{wrong[0]}: checkpoint {list(specs[wrong[0]].shape)}, this model {list(expected[wrong[0]].shape)}")
        raise CheckpointError(f"the parts of {ckpt} do not hold this model's parameters ({what}); resume the model "
                              "they came from")


def save_pipeline(run: Any, out: str | Path, step: int, data_position: int = 0, keep: int = 2,
                  run_config: dict[str, Any] | None = None) -> Path:
    """Every rank together, between steps: a checkpoint of the pipelined run ``run`` (``tiertrain.pipeline``'s)
    at ``step`` in ``out/checkpoints/``; it resumes with ``load_pipeline`` at any pp and dp, or in one
    process (``train --resume``, ``checkpoint.run.load_checkpoint``). The ``keep`` newest are kept."""
    record = PipelineRecord(run.layout.pp, run.layout.stages, run.mesh.world.world_size)
    return save_pipelined(Path(out), list(zip(run.indices, run.stages)), run.mesh.world, record,
                          run.optimizer.param_groups, TrainerState(step, data_position, {}, run_config or {}), keep)


def load_pipeline(run: Any, path: str | Path) -> TrainerState:
    """Every rank together: ``run``'s stages from a pipelined checkpoint of any layout (a run directory's
    latest, or one checkpoint directory); the step and data position it was saved at."""
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint

    ckpt = find_checkpoint(Path(path))
    states = [load_checkpoint(ckpt, TieredState(stage)) for stage in run.stages]
    return states[-1]
