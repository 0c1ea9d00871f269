"""Whole-run checkpoints: model, optimizer, LR schedule position, data position, RNG states.

Layout of ``OUT/checkpoints/``::

    step-00000100/model.safetensors      weights; loads in plain PyTorch (and transformers
                  config.json            for transformers models, with config.json)
                  optimizer.safetensors  AdamW state keyed "<param name>::<state name>"
                  rng.safetensors        torch RNG states
                  trainer.json           step, data position, loss scaler, RNG of python/numpy,
                                         run config, write stamp, and a CRC-32C of every file above
    latest                               name of the newest complete checkpoint

Weights and optimizer state are written tensor by tensor (``tensor_file``) and read back one
tensor at a time, so a tiered run larger than memory saves and resumes within its budgets.
A checkpoint is written into a temporary directory and published by rename, then
``latest`` is replaced atomically; a crash at any point leaves the previous checkpoint
intact and ``latest`` pointing at it, and a failed write (out of space) removes what it
wrote. Nothing is ever unpickled.

Loading trusts nothing a checkpoint says until it is checked: ``trainer.json`` is read by the
typed loader (every field's type and range), its manifest names only plain file names inside
the checkpoint, every file the loader reads is listed there and verified before it is read,
files are opened only as regular files (never through a symlink), ``latest`` names only a
sibling ``step-*`` directory, tensors' names, dtypes and shapes are checked from the headers
before any is loaded, and run options that choose where tiertrain writes or deletes are never
taken from a checkpoint. Every refusal is one ``CheckpointError`` and changes nothing on disk.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from crc32c import crc32c
from safetensors import SafetensorError
from safetensors.torch import save_file

from tiertrain import typed
from tiertrain.checkpoint.atomic import publish_dir, write_atomic
from tiertrain.checkpoint.pieces import SUFFIX as PIECES
from tiertrain.checkpoint.regular_file import FIX as _FIX, open_regular, read_small
from tiertrain.checkpoint.sharded import (SHARD_FILE, ShardedTensors, ShardMap, check_shard_files, rank_files,
                                                agreed_steps, experts_held_elsewhere, shard_file, shard_map,
                                                write_rank_file)
from tiertrain.checkpoint.train_state import TrainState, checked_groups
from tiertrain.errors import CheckpointError, OutputError, one_line
from tiertrain.optim.hparams import MOMENTS
from tiertrain.tensor_file import LazyTensors, TensorSpec, write_streamed
from tiertrain.units import format_bytes

FORMAT_VERSION = 1
_CRC = "crc32c:"  # manifest digests say their algorithm; one without a prefix is a sha256 (older checkpoints)
LATEST = "latest"
NEEDED = ("config.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors")  # what loading reads
# Run options that choose where tiertrain writes or deletes, or allow it to replace a run: they come from
# the command line only, never from a checkpoint (one could be crafted, or copied from another machine).
NOT_FROM_CHECKPOINT = ("out", "resume", "disk", "overwrite")
MAX_JSON_BYTES = 4 << 20  # a trainer.json is ~20 KiB; a damaged or crafted one of gigabytes is never read in full
_MAX_COUNT = 2**63 - 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")  # a plain file name: no separator, no "..", not absolute
_STEP_DIR = re.compile(r"step-[0-9]{8,20}")
_DIGEST = re.compile(r"crc32c:[0-9a-f]{8}|[0-9a-f]{64}")
_CUDA_RNG = re.compile(r"torch_cuda_[0-9]{1,4}")


@dataclass
class TrainerState:
    """What besides tensors a resumed run needs."""

    step: int
    data_position: int
    scaler: dict[str, Any]
    run_config: dict[str, Any]
    world: int = 1  # the ranks the run trained on when it saved


@dataclass(frozen=True)
class SavedRng:
    """Python's and numpy's generator states as JSON lists (torch's are in rng.safetensors)."""

    numpy: tuple[str, tuple[int, ...], int, int, float]
    python: tuple[int, tuple[int, ...], float | None]


@dataclass(frozen=True)
class SavedScaler:
    """The fp16 loss scaler's state (GradScaler's keys, which the tiered runtime's scaler shares)."""

    scale: float = field(metadata=typed.above(0))
    growth_factor: float = field(metadata=typed.at_least(1))
    backoff_factor: float = field(metadata={**typed.above(0), "max": 1})
    growth_interval: int = field(metadata=typed.between(1, _MAX_COUNT))
    _growth_tracker: int = field(metadata=typed.between(0, _MAX_COUNT))


@dataclass(frozen=True)
class TrainerFile:
    """``trainer.json`` as the typed loader checks it: a wrong type or range anywhere is one error."""

    format_version: int
    step: int = field(metadata=typed.between(0, _MAX_COUNT))
    data_position: int = field(metadata=typed.between(0, _MAX_COUNT))
    scaler: dict[str, Any]
    run_config: dict[str, Any]
    rng: SavedRng
    param_groups: list[Any]
    files: dict[str, Any]
    shards: dict[str, Any] | None = None  # a data-parallel run's: which rank file holds what (sharded_checkpoint)
    pipeline: dict[str, Any] | None = None  # a pipelined run's: its stages' sub-checkpoints (checkpoint.pipelined)
    tensor: dict[str, Any] | None = None  # a tensor-parallel run's: its ranks' shards (checkpoint.tensor_parallel)
    saved_at_ns: int | None = field(default=None, metadata=typed.between(0, _MAX_COUNT))  # older ones lack it


def checkpoint_root(out: Path) -> Path:
    return out / "checkpoints"


def model_config_dict(model: nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "to_dict") and hasattr(cfg, "model_type"):
        return cfg.to_dict()  # transformers: from_pretrained reads this back
    if cfg is not None and hasattr(cfg, "to_dict"):
        return {"tiertrain_model": cfg.to_dict()}
    raise CheckpointError(f"cannot describe {type(model).__name__}'s config for a checkpoint")


# ---------------------------------------------------------------- reading files, confined


def _file_blocks(path: Path) -> Iterator[bytes]:
    with open(open_regular(path), "rb") as f:
        yield from iter(lambda: f.read(1 << 24), b"")


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_small(path, MAX_JSON_BYTES))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({one_line(exc)}); {_FIX}") from None


def file_digest(path: Path) -> str:
    """What a manifest records of a file: its CRC-32C (damage, not tampering, is what it detects)."""
    crc = 0
    for block in _file_blocks(path):
        crc = crc32c(block, crc)
    return _CRC + f"{crc:08x}"


def _digest_matches(path: Path, recorded: str) -> bool:
    if recorded.startswith(_CRC):
        return file_digest(path) == recorded
    h = hashlib.sha256()  # checkpoints written before manifests used CRC-32C
    for block in _file_blocks(path):
        h.update(block)
    return h.hexdigest() == recorded


# ---------------------------------------------------------------- saving


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    py_state = random.getstate()
    plain = {"numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "python": [py_state[0], list(py_state[1]), py_state[2]]}
    return tensors, plain


def save_checkpoint(out: Path, ts: TrainState, state: TrainerState, keep: int) -> Path:
    """Write a checkpoint for ``state.step`` atomically and prune to the ``keep`` most recently
    written (never the one just written, nor the one ``latest`` names). A write that fails (out
    of space) removes its temporary directory, leaves the previous checkpoint and ``latest`` as
    they were, and is one ``OutputError`` naming the directory, its free space and the fix."""
    comm = getattr(getattr(ts, "rt", None), "comm", None)
    if comm is not None and comm.world_size > 1:
        return _save_sharded(out, ts, state, keep, comm)
    root = checkpoint_root(out)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root)
        tmp.mkdir()
        write_files(tmp, ts, state)
        publish_dir(tmp, final)
        write_atomic(root / LATEST, final.name.encode())
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError)):
            raise _save_failed(root, final.name, exc) from None
        raise
    prune(root, keep, final.name)
    return final


def write_files(tmp: Path, ts: TrainState, state: TrainerState) -> None:
    """Every file of a checkpoint, into its temporary directory."""
    rng_tensors, rng_plain = rng_state()
    # weights and moments stream block by block: a tiered run's may be larger than memory
    crcs = {"model.safetensors": write_streamed(tmp / "model.safetensors", ts.weights(), {"format": "pt"}),
            "optimizer.safetensors": write_streamed(tmp / "optimizer.safetensors", ts.optimizer_tensors())}
    save_file(rng_tensors, tmp / "rng.safetensors")
    (tmp / "config.json").write_text(json.dumps(model_config_dict(ts.module), indent=2))
    manifest = {p.name: _CRC + f"{crcs[p.name]:08x}" if p.name in crcs else file_digest(p) for p in sorted(tmp.iterdir())}
    trainer = {"format_version": FORMAT_VERSION, "step": state.step, "data_position": state.data_position,
               "scaler": state.scaler, "run_config": state.run_config, "rng": rng_plain,
               "param_groups": ts.group_hparams(), "files": manifest, "saved_at_ns": write_stamp()}
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))


def agreement(comm: Any, root: Path, name: str, tmp: Path) -> Any:
    """``agree(work)``: run ``work`` on this rank, then agree over ``comm``'s ranks whether any failed (a
    collective every rank calls together); where one did, rank 0 removes ``tmp`` and every rank raises,
    this rank its own error or one saying another rank's failed (the previous checkpoint is intact)."""
    def agree(work: Any) -> None:
        try:
            work()
            error = None
        except Exception as exc:  # noqa: BLE001 - any failure must reach the agreement, or the others wait in it
            error = exc
        flag = torch.tensor([1.0 if error is not None else 0.0])
        comm.host.all_reduce(flag, op="max")
        if flag.item():
            if comm.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is not None and not isinstance(error, (OSError, SafetensorError)):
                raise error  # not the disk's: as it was raised
            raise (_save_failed(root, name, error) if error is not None
                   else OutputError(f"cannot save checkpoint {name} in {root}: another rank could not write "
                                    "its shards (its error says why; the previous checkpoint is intact)"))

    return agree


def prepare_dir(root: Path, tmp: Path) -> None:
    """Rank 0's first step of a many-rank save: the checkpoints' folder, stale temporaries gone, ``tmp`` fresh."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def check_sees(tmp: Path, rank: int) -> None:
    if not tmp.is_dir():  # rank 0 made it: this rank saves on another filesystem
        raise UnsharedDirectory(errno.ENOENT, f"{tmp}, which rank 0 made, is not there as rank {rank} sees "
                                "it: every rank must save into one filesystem they share (--out on NFS, Lustre...)")


def _save_sharded(out: Path, ts: TrainState, state: TrainerState, keep: int, comm: Any) -> Path:
    """A data-parallel run's checkpoint: every rank writes its own file into one temporary directory
    that rank 0 made, rank 0 adds the rest and publishes it. The ranks agree at each stage (a failure
    on any rank fails the save on all of them, with the temporary directory removed)."""
    save = ManyRankSave.begin(out, state.step, comm, "ranks")
    write_sharded(save.tmp, ts, state, comm, save.agree)
    return save.publish(keep)


@dataclass
class ManyRankSave:
    """A checkpoint every rank of ``comm`` writes into one temporary directory rank 0 made, published by rank
    0 once every rank's part is there (``agree``: each step's failure on any rank fails it on all)."""

    root: Path
    final: Path
    tmp: Path
    comm: Any
    agree: Any

    @classmethod
    def begin(cls, out: Path, step: int, comm: Any, kind: str) -> ManyRankSave:
        root = checkpoint_root(out)
        final = root / f"step-{step:08d}"
        tmp = root / f".{final.name}.tmp-{kind}"
        agree = agreement(comm, root, final.name, tmp)
        agree(lambda: prepare_dir(root, tmp) if comm.rank == 0 else None)
        agree(lambda: check_sees(tmp, comm.rank))
        return cls(root, final, tmp, comm, agree)

    def publish(self, keep: int) -> Path:
        self.agree(lambda: publish(self.root, self.tmp, self.final) if self.comm.rank == 0 else None)
        if self.comm.rank == 0:
            prune(self.root, keep, self.final.name)
        return self.final


def write_sharded(tmp: Path, ts: TrainState, state: TrainerState, comm: Any, agree: Any) -> None:
    """Every file of a data-parallel run's checkpoint into ``tmp``, which every rank of ``comm`` sees: each
    rank its own shards, rank 0 the rest (a pipeline's stage writes its sub-checkpoint so too)."""
    agree(ts.rt.wait_updates)  # an update's failure (a disk error) fails the save on every rank alike
    steps = agreed_steps(ts.rt)  # the last collective before the ranks write: a failed write leaves none waiting
    crc = [0]
    agree(lambda: crc.__setitem__(0, write_rank_file(tmp, ts.rt, steps)))
    crcs = torch.zeros(comm.world_size, dtype=torch.int64)
    comm.host.all_gather(crcs, torch.tensor([crc[0]], dtype=torch.int64))
    written = crcs[: rank_files(ts.rt)].tolist()  # ranks past the files wrote none (hybrid sharding's replicas)
    agree(lambda: _write_sharded_trainer(tmp, ts, state, written) if comm.rank == 0 else None)


def _write_sharded_trainer(tmp: Path, ts: TrainState, state: TrainerState, crcs: list[int]) -> None:
    rng_tensors, rng_plain = rng_state()
    save_file(rng_tensors, tmp / "rng.safetensors")
    (tmp / "config.json").write_text(json.dumps(model_config_dict(ts.module), indent=2))
    smap = shard_map(ts.rt)
    missing = [name for r in range(len(crcs)) for name in (shard_file(r, len(crcs)), shard_file(r, len(crcs)) + PIECES)
               if not (tmp / name).is_file()]
    if missing:  # the ranks wrote into a directory rank 0 does not see: not one filesystem
        raise UnsharedDirectory(errno.ENOENT, f"{', '.join(missing[:2])} written by the other ranks are not in {tmp} as "
                                "rank 0 sees it: every rank must save into one filesystem they share (--out on NFS, "
                                "Lustre...)")
    manifest = {p.name: file_digest(p) for p in sorted(tmp.iterdir()) if not SHARD_FILE.fullmatch(p.name)}
    manifest.update({shard_file(r, len(crcs)): _CRC + f"{c:08x}" for r, c in enumerate(crcs)})
    trainer = {"format_version": FORMAT_VERSION, "step": state.step, "data_position": state.data_position,
               "scaler": state.scaler, "run_config": state.run_config, "rng": rng_plain,
               "param_groups": ts.group_hparams(), "files": manifest, "saved_at_ns": write_stamp(),
               "shards": json.loads(json.dumps(_map_dict(smap)))}
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))


def publish(root: Path, tmp: Path, final: Path) -> None:
    publish_dir(tmp, final)
    write_atomic(root / LATEST, final.name.encode())


def _map_dict(smap: ShardMap) -> dict:
    """The map as ``trainer.json`` holds it: ``ranks`` only where the run had more ranks than files
    (hybrid sharding), so a checkpoint of any other run reads as it did before the field existed."""
    out = asdict(smap)
    if not smap.ranks:
        del out["ranks"]
    return out


def write_stamp() -> int:
    """When a checkpoint was written (ns since the epoch): pruning keeps the most recently written."""
    return time.time_ns()


class UnsharedDirectory(OSError):
    """The ranks of a sharded save do not see one directory (they run on nodes without a shared filesystem)."""


def _save_failed(root: Path, name: str, exc: BaseException) -> OutputError:
    """The one-line error of a save that could not be written (most often: the disk is full)."""
    if isinstance(exc, UnsharedDirectory):
        return OutputError(f"cannot save checkpoint {name} in {root}: {exc.strerror} (the previous checkpoint is "
                           "intact)")
    try:
        free = f"{format_bytes(shutil.disk_usage(root).free)} free there"
    except OSError:
        free = "free space unknown"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
    return OutputError(f"cannot save checkpoint {name} in {root}: {reason} ({free}); free some space there or "
                       "choose another --out (the previous checkpoint is intact)")


def remove_stale(root: Path) -> None:
    """Remove half-written checkpoints (and ``latest`` files) left by a run that died while saving."""
    for p in [*root.glob(".step-*"), *root.glob(f".{LATEST}.tmp-*")]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)  # a link is removed as a name; what it points at is never touched


def prune(root: Path, keep: int, written: str) -> None:
    """Remove the checkpoints beyond the ``keep`` most recently written. Order is by write stamp,
    not step number: a new or resumed run writing lower steps than an older run in the same
    directory must not delete its own checkpoints. The one just written and the one ``latest``
    names are never removed, even when that keeps more than ``keep``."""
    done = sorted(_checkpoint_dirs(root), key=_written_order)
    protect = {written, _latest_name(root)}
    excess = len(done) - keep
    for p in [p for p in done if p.name not in protect][:max(0, excess)]:
        shutil.rmtree(p, ignore_errors=True)


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under ``root``: ``step-N`` directories themselves, not symlinks."""
    return [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and _is_real_dir(p)]


def _written_order(ckpt: Path) -> tuple[int, int, int]:
    """Oldest first: by write stamp; a checkpoint without one (older tiertrain, or unreadable)
    counts as older than any with one, and these are ordered by step."""
    step = int(ckpt.name.removeprefix("step-"))
    try:
        stamp = read_json(ckpt / "trainer.json").get("saved_at_ns")
    except (CheckpointError, AttributeError):
        stamp = None
    if isinstance(stamp, int) and not isinstance(stamp, bool):
        return (1, stamp, step)
    return (0, 0, step)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------- finding a checkpoint


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or the newest complete one of a run directory (through ``latest``,
    which must name a sibling ``step-*`` directory)."""
    if os.path.lexists(path / "trainer.json"):
        return path
    for root in (path, checkpoint_root(path)):
        if os.path.lexists(root / LATEST):
            return _latest_checkpoint(root)
    raise CheckpointError(
        f"no checkpoint found at {path}; give a run's --out directory or a checkpoints/step-* directory"
    )


def _latest_checkpoint(root: Path) -> Path:
    """The checkpoint ``root/latest`` names: a plain ``step-N`` directory beside it, never a path
    that leads elsewhere (``..``, absolute, a symlink)."""
    latest = root / LATEST
    if latest.is_symlink():
        raise CheckpointError(f"{latest} is a symbolic link, which is never followed; "
                              "give --resume a checkpoints/step-* directory")
    try:
        name = read_small(latest, 256).decode("ascii").strip()
    except (CheckpointError, UnicodeDecodeError):
        name = None
    if name is None or not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{latest} does not name a checkpoint beside it (step-NNNNNNNN); it is damaged: "
                              "give --resume a checkpoints/step-* directory")
    ckpt = root / name
    if not _is_real_dir(ckpt) or not os.path.lexists(ckpt / "trainer.json"):
        raise CheckpointError(f"{latest} names {name}, which is not a complete checkpoint directory in {root}; "
                              "give --resume a checkpoints/step-* directory")
    return ckpt


def _latest_name(root: Path) -> str | None:
    try:
        return _latest_checkpoint(root).name
    except CheckpointError:
        return None


def saved_run_options(path: Path) -> dict[str, Any]:
    """The options the run of the checkpoint at ``path`` was started with, as the defaults for
    resuming it (flags and a config file still win). Without them, ``--resume OUT`` alone would
    build the default model and refuse the checkpoint as another model's. Options naming where
    tiertrain writes or deletes (``NOT_FROM_CHECKPOINT``) are left out: those come from the
    command line only."""
    run = read_trainer(find_checkpoint(path)).run_config
    return {k: v for k, v in run.items() if k not in NOT_FROM_CHECKPOINT}


def saved_world(path: Path) -> int:
    """The ranks the run of the checkpoint at ``path`` trained on: a resume keeps them unless told otherwise."""
    trainer = read_trainer(find_checkpoint(path))
    parts = trainer.pipeline or trainer.tensor
    if parts is not None:
        return int(parts["ranks"])
    shards = trainer.shards
    return int(shards.get("ranks") or shards["world"]) if shards is not None else 1


# ---------------------------------------------------------------- checking what a checkpoint says


def read_trainer(ckpt: Path) -> TrainerFile:
    """``trainer.json``, every field checked (typed loader), its manifest names and digests, its
    RNG states and its loss scaler; one ``CheckpointError`` for anything wrong inside."""
    path = ckpt / "trainer.json"
    data = read_json(path)
    if isinstance(data, dict) and data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt} has format {_short(data.get('format_version'))}, "
                              f"this tiertrain reads {FORMAT_VERSION}; {_FIX}")
    try:
        trainer = typed.load(TrainerFile, data, f"checkpoint file {path}", error=CheckpointError)
        if trainer.scaler:
            scaler = typed.load(SavedScaler, trainer.scaler, f"checkpoint file {path}: scaler", error=CheckpointError)
            trainer = _replace(trainer, scaler=asdict(scaler))
    except CheckpointError as exc:
        raise CheckpointError(f"{one_line(exc)}; the file is damaged or was edited: {_FIX}") from None
    _check_parts_record(path, trainer)
    _check_manifest(path, trainer.files, _needed(path, trainer))
    _check_plain_rng(path, trainer.rng)
    return trainer


def _check_parts_record(path: Path, trainer: TrainerFile) -> None:
    """A pipelined or tensor-parallel checkpoint's record of its sub-checkpoints, every field checked."""
    from tiertrain.checkpoint.pipelined import PipelineRecord
    from tiertrain.checkpoint.tensor_parallel import TensorRecord

    for kind, value in (("pipeline", trainer.pipeline), ("tensor", trainer.tensor)):
        if value is None:
            continue
        try:
            typed.load(PipelineRecord if kind == "pipeline" else TensorRecord, value, f"checkpoint file {path}: {kind}",
                       error=CheckpointError)
        except CheckpointError as exc:
            raise CheckpointError(f"{one_line(exc)}; the file is damaged or was edited: {_FIX}") from None


def _needed(path: Path, trainer: TrainerFile) -> tuple[str, ...]:
    """The files loading reads: a sharded checkpoint's rank files instead of the model and optimizer files;
    a pipelined one's stages are sub-checkpoints, each with its own manifest."""
    if trainer.pipeline is not None or trainer.tensor is not None:
        return ("config.json", "rng.safetensors")
    if trainer.shards is None:
        return NEEDED
    world = trainer.shards.get("world") if isinstance(trainer.shards, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or not 2 <= world <= 1 << 16:
        raise CheckpointError(f"{path}: its shards name no world size; the file is damaged or was edited: {_FIX}")
    return ("config.json", "rng.safetensors", *(shard_file(r, world) for r in range(world)))


def _replace(trainer: TrainerFile, **changes: Any) -> TrainerFile:
    return TrainerFile(**{**{f: getattr(trainer, f) for f in trainer.__dataclass_fields__}, **changes})


def _check_manifest(path: Path, files: dict[str, Any], needed: tuple[str, ...] = NEEDED) -> None:
    """Every name a plain file name (nothing outside the checkpoint is ever opened), every digest
    a digest, and every file the loader reads listed (so none is read unverified)."""
    for name, digest in files.items():
        if not _NAME.fullmatch(name):
            raise CheckpointError(f"{path} lists {_short(name)}, which is not a plain file name inside the "
                                  f"checkpoint; its manifest is damaged or crafted: {_FIX}")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise CheckpointError(f"{path} records {_short(digest)} as the checksum of {name}, which is not one; "
                                  f"its manifest is damaged: {_FIX}")
    missing = [n for n in needed if n not in files]
    if missing:
        raise CheckpointError(f"{path} lists no checksum for {', '.join(missing)}, and nothing unverified is read; "
                              f"its manifest is damaged: {_FIX}")


def _check_plain_rng(path: Path, rng: SavedRng) -> None:
    """Python's and numpy's states must be states of their Mersenne Twisters: both accept many
    wrong ones silently (Python takes version 2 and out-of-range words, numpy a position of 700)."""
    version, words, gauss = rng.python
    if version != 3 or len(words) != 625 or not all(0 <= w < 2**32 for w in words[:-1]) or not 0 <= words[-1] <= 624:
        raise CheckpointError(f"{path}: rng.python is not a state of Python's random generator; {_FIX}")
    name, keys, pos, has_gauss, _cached = rng.numpy
    if name != "MT19937" or len(keys) != 624 or not all(0 <= k < 2**32 for k in keys) or not 0 <= pos <= 624 \
            or has_gauss not in (0, 1):
        raise CheckpointError(f"{path}: rng.numpy is not a state of numpy's MT19937 generator; {_FIX}")
    try:  # on scratch generators: nothing global changes before everything is checked
        random.Random().setstate((version, words, gauss))
        np.random.RandomState().set_state(_numpy_state(rng))
    except (ValueError, TypeError, OverflowError) as exc:
        raise CheckpointError(f"{path}: rng is not a generator state ({one_line(exc)}); {_FIX}") from None


def _numpy_state(rng: SavedRng) -> tuple:
    name, keys, pos, has_gauss, cached = rng.numpy
    return (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)


def checked_whole(files: dict[str, str]) -> dict[str, str]:
    """The manifest's files that are verified whole before anything is read: all but the rank files
    checked piece by piece as they are read (``checkpoint.pieces``; their piece lists are verified whole)."""
    return {name: digest for name, digest in files.items() if not (SHARD_FILE.fullmatch(name) and name + PIECES in files)}


def verify_files(ckpt: Path, manifest: dict[str, str]) -> None:
    for name, digest in manifest.items():
        path = ckpt / name
        if not _digest_matches(path, digest):
            raise CheckpointError(
                f"checkpoint file {path} is missing or damaged (checksum mismatch); "
                "resume from an earlier checkpoint"
            )


def check_same_model(ckpt: Path, model: nn.Module) -> None:
    path = ckpt / "config.json"
    saved = read_json(path)
    if not isinstance(saved, dict) or not isinstance(saved.get("tiertrain_model", saved), dict):
        raise CheckpointError(f"checkpoint file {path} does not describe a model (not a mapping); {_FIX}")
    current = json.loads(json.dumps(model_config_dict(model)))  # as saved: JSON makes int keys (id2label's) text
    drop = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "name"}
    strip = (lambda d: {k: v for k, v in d.items() if k not in drop})
    a = strip(saved.get("tiertrain_model", saved))
    b = strip(current.get("tiertrain_model", current))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        detail = ", ".join(f"{_key(k)}: checkpoint {_short(a.get(k))} vs this run {_short(b.get(k))}" for k in diff[:4])
        raise CheckpointError(
            f"checkpoint {ckpt} is from a different model ({detail}); "
            "resume with the model it was saved from, or start a new run in another --out"
        )


def is_stage(module: nn.Module) -> bool:
    """A pipeline's stage holds some of the model's parameters: it reads its own out of a whole model's."""
    from tiertrain.models.stages import PipelineStageModule

    return isinstance(module, PipelineStageModule)


def _checked_weights(ckpt: Path, ts: TrainState) -> LazyTensors:
    """The saved weights, read one tensor at a time as they are loaded, after their names, dtypes
    and shapes are checked against this model's from the file's header."""
    tensors = LazyTensors(ckpt / "model.safetensors")
    expected = ts.expected_weights()
    odd = sorted(set(expected) - set(tensors) if is_stage(ts.module) else set(tensors) ^ set(expected))
    detail = f"{_short(odd[0])} is in only one of them" if odd else next(
        (f"{k}: checkpoint {_desc(tensors.dtype(k), tensors.shape(k))}, this model {_desc(s.dtype, s.shape)}"
         for k, s in expected.items() if (tensors.dtype(k), tensors.shape(k)) != (s.dtype, s.shape)), None)
    if detail:
        raise CheckpointError(f"weights in {ckpt} do not match this model's parameters ({detail}); "
                              "resume the model they came from")
    return tensors


def _checked_optimizer(ckpt: Path, ts: TrainState) -> LazyTensors:
    """The saved AdamW state after each key is checked to be a step or a moment of one of this
    model's parameters, with the dtype and shape that one needs, and each parameter's state whole."""
    path = ckpt / "optimizer.safetensors"
    tensors = LazyTensors(path)
    expected = ts.expected_moments()
    stage = is_stage(ts.module)
    kinds: dict[str, set[str]] = {}
    for key in tensors:
        name, sep, kind = key.partition("::")
        spec = expected.get(name)
        if stage and sep and spec is None:
            continue  # another stage's parameter
        if not sep or spec is None or kind not in ("step", *MOMENTS):
            raise CheckpointError(f"optimizer state {_short(key)} in {path} is no AdamW state of this model's "
                                  "parameters; resume the model it came from")
        want = TensorSpec(key, torch.float32, ()) if kind == "step" else TensorSpec(key, spec.dtype, spec.shape)
        got = (tensors.dtype(key), tensors.shape(key))
        if got != (want.dtype, want.shape):
            raise CheckpointError(f"optimizer state {key!r} in {path} is {_desc(*got)}, this model needs "
                                  f"{_desc(want.dtype, want.shape)}; resume the model it came from")
        kinds.setdefault(name, set()).add(kind)
    partial = sorted(n for n, k in kinds.items() if len(k) != 1 + len(MOMENTS))
    if partial:
        raise CheckpointError(f"optimizer state in {path} lacks the step or a moment of {partial[0]!r}; {_FIX}")
    return tensors


def _checked_rng(ckpt: Path) -> dict[str, torch.Tensor]:
    """torch's generator states, each checked as one (uint8, the size torch expects) before any is set."""
    path = ckpt / "rng.safetensors"
    tensors = LazyTensors(path)
    cpu = tuple(torch.get_rng_state().shape)
    for key in tensors:
        if key != "torch_cpu" and not _CUDA_RNG.fullmatch(key):
            raise CheckpointError(f"{path} holds {_short(key)}, which is no torch RNG state; {_FIX}")
        dtype, shape = tensors.dtype(key), tensors.shape(key)
        if dtype != torch.uint8 or len(shape) != 1 or (key == "torch_cpu" and shape != cpu) or shape[0] > 1 << 20:
            want = f"uint8 {list(cpu)}" if key == "torch_cpu" else "uint8 [n]"
            raise CheckpointError(f"{path} holds {key} as {_desc(dtype, shape)}, a torch RNG state is {want}; {_FIX}")
    if "torch_cpu" not in tensors:
        raise CheckpointError(f"{path} holds no torch_cpu RNG state; {_FIX}")
    states = {k: tensors[k] for k in tensors}
    try:
        torch.Generator().set_state(states["torch_cpu"])  # a scratch generator: the global one is set last
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path}: torch_cpu is not a generator state ({one_line(exc)}); {_FIX}") from None
    return states


def _restore_rng(tensors: dict[str, torch.Tensor], plain: SavedRng) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    np.random.set_state(_numpy_state(plain))
    version, words, gauss = plain.python
    random.setstate((version, words, gauss))


def load_checkpoint(ckpt: Path, ts: TrainState) -> TrainerState:
    """Restore model, optimizer and RNG from ``ckpt`` after verifying it; return the rest.

    Everything is checked before anything is changed: trainer.json, every file's checksum (a rank
    file's piece by piece, each piece before its bytes are used), the model's config, the parameter
    groups, and each file's tensor names, dtypes and shapes."""
    from tiertrain.checkpoint.tensor_parallel import cut_for, whole_view

    trainer = read_trainer(ckpt)
    verify_files(ckpt, checked_whole(trainer.files))
    check_same_model(ckpt, ts.module)
    groups = checked_groups(trainer.param_groups, ts.group_hparams(), f"checkpoint {ckpt}")
    reader = ts
    whole = whole_view(ts) if trainer.tensor is None else None
    if whole is not None:  # saved whole, read by a run cut over tensor-parallel ranks: checked whole, then cut
        ts = whole  # type: ignore[assignment]
    if trainer.pipeline is not None:
        from tiertrain.checkpoint.pipelined import stage_tensors

        weights, optim = stage_tensors(ckpt, trainer, ts)
    elif trainer.tensor is not None:
        from tiertrain.checkpoint.tensor_parallel import shard_tensors

        weights, optim = shard_tensors(ckpt, trainer, ts)
    elif trainer.shards is not None:
        smap = ShardMap.read(trainer.shards, f"checkpoint file {ckpt / 'trainer.json'}: shards")
        expected = ts.expected_weights()
        held_elsewhere = experts_held_elsewhere(smap, expected) if getattr(ts, "expert_parallel", False) else None
        if is_stage(ts.module):  # the other stages' parameters
            held_elsewhere = frozenset(n for b in smap.blocks for n, _, _ in b.params if n not in expected)
        check_shard_files(ckpt, smap, expected, held_elsewhere or frozenset())
        weights = ShardedTensors(ckpt, smap, moments=False)
        optim = weights.moments_too()
    else:
        weights, optim = _checked_weights(ckpt, ts), _checked_optimizer(ckpt, ts)
    if whole is not None:
        weights, optim = cut_for(reader, weights, optim)
    rng = _checked_rng(ckpt)
    try:
        reader.load(weights, optim, groups)
    finally:
        if hasattr(weights, "close"):
            weights.close()
    _restore_rng(rng, trainer.rng)
    parts = trainer.pipeline or trainer.tensor
    world = parts["ranks"] if parts is not None else (smap.run_ranks if trainer.shards is not None else 1)
    return TrainerState(step=trainer.step, data_position=trainer.data_position,
                        scaler=dict(trainer.scaler), run_config=dict(trainer.run_config), world=world)


# ---------------------------------------------------------------- messages


def _desc(dtype: torch.dtype | None, shape: tuple[int, ...]) -> str:
    name = str(dtype).removeprefix("torch.") if dtype is not None else "an unknown dtype"
    return f"{name} {list(shape)}"


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` of a value read from a file, cut short: an error line stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(name: str) -> str:
    """A config key as is when it reads plainly, else quoted and cut short."""
    return name if name.isprintable() and len(name) <= 80 else _short(name)
