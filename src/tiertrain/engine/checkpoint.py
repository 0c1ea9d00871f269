"""Whole-run checkpoints: model, optimizer, LR schedule position, data position, RNG states.

Layout of ``OUT/checkpoints/``::

    step-00000100/model.safetensors      weights; loads in plain PyTorch (and transformers
                  config.json            for transformers models, with config.json)
                  optimizer.safetensors  AdamW state keyed "<param name>::<state name>"
                  rng.safetensors        torch RNG states
                  trainer.json           step, data position, loss scaler, RNG of python/numpy,
                                         run config, and a CRC-32C of every file above
    latest                               name of the newest complete checkpoint

Weights and optimizer state are written tensor by tensor (``tensor_file``) and read back one
tensor at a time, so a tiered run larger than memory saves and resumes within its budgets.
A checkpoint is written into a temporary directory and published by rename, then
``latest`` is replaced atomically; a crash at any point leaves the previous checkpoint
intact and ``latest`` pointing at it. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from crc32c import crc32c
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tiertrain.engine.atomic import publish_dir, write_atomic
from tiertrain.engine.train_state import TrainState
from tiertrain.errors import CheckpointError
from tiertrain.tensor_file import LazyTensors, write_streamed

FORMAT_VERSION = 1
_CRC = "crc32c:"  # manifest digests say their algorithm; one without a prefix is a sha256 (older checkpoints)
LATEST = "latest"


@dataclass
class TrainerState:
    """What besides tensors a resumed run needs."""

    step: int
    data_position: int
    scaler: dict[str, Any]
    run_config: dict[str, Any]


def checkpoint_root(out: Path) -> Path:
    return out / "checkpoints"


def model_config_dict(model: nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "to_dict") and hasattr(cfg, "model_type"):
        return cfg.to_dict()  # transformers: from_pretrained reads this back
    if cfg is not None and hasattr(cfg, "to_dict"):
        return {"tiertrain_model": cfg.to_dict()}
    raise CheckpointError(f"cannot describe {type(model).__name__}'s config for a checkpoint")


def _file_blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(1 << 24), b"")


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


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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
    """Write a checkpoint for ``state.step`` atomically and prune to the ``keep`` newest."""
    root = checkpoint_root(out)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    rng_tensors, rng_plain = _rng_state()
    # weights and moments stream block by block: a tiered run's may be larger than memory
    crcs = {"model.safetensors": write_streamed(tmp / "model.safetensors", ts.weights(), {"format": "pt"}),
            "optimizer.safetensors": write_streamed(tmp / "optimizer.safetensors", ts.optimizer_tensors())}
    save_file(rng_tensors, tmp / "rng.safetensors")
    (tmp / "config.json").write_text(json.dumps(model_config_dict(ts.module), indent=2))
    manifest = {p.name: _CRC + f"{crcs[p.name]:08x}" if p.name in crcs else file_digest(p) for p in sorted(tmp.iterdir())}
    trainer = {"format_version": FORMAT_VERSION, "step": state.step, "data_position": state.data_position,
               "scaler": state.scaler, "run_config": state.run_config, "rng": rng_plain,
               "param_groups": ts.group_hparams(), "files": manifest}
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))
    publish_dir(tmp, final)
    write_atomic(root / LATEST, final.name.encode())
    _prune(root, keep)
    return final


def remove_stale(root: Path) -> None:
    """Remove half-written checkpoints left by a run that died while saving."""
    for p in root.glob(".step-*"):
        shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or the newest complete one of a run directory."""
    if (path / "trainer.json").is_file():
        return path
    for root in (path, checkpoint_root(path)):
        latest = root / LATEST
        if latest.is_file():
            ckpt = root / latest.read_text().strip()
            if (ckpt / "trainer.json").is_file():
                return ckpt
    raise CheckpointError(
        f"no checkpoint found at {path}; give a run's --out directory or a checkpoints/step-* directory"
    )


def saved_run_options(path: Path) -> dict[str, Any]:
    """The options the run of the checkpoint at ``path`` was started with, as the defaults for
    resuming it (flags and a config file still win). Without them, ``--resume OUT`` alone would
    build the default model and refuse the checkpoint as another model's."""
    ckpt = find_checkpoint(path)
    run = _read_json(ckpt / "trainer.json").get("run_config", {})
    return {k: v for k, v in run.items() if k not in ("resume", "out")}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({exc}); resume from another checkpoint") from None


def _verify_files(ckpt: Path, manifest: dict[str, str]) -> None:
    for name, digest in manifest.items():
        path = ckpt / name
        if not path.is_file() or not _digest_matches(path, digest):
            raise CheckpointError(
                f"checkpoint file {path} is missing or damaged (checksum mismatch); "
                "resume from an earlier checkpoint"
            )


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def check_same_model(ckpt: Path, model: nn.Module) -> None:
    saved = _read_json(ckpt / "config.json")
    current = model_config_dict(model)
    drop = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "name"}
    strip = (lambda d: {k: v for k, v in d.items() if k not in drop})
    a = strip(saved.get("tiertrain_model", saved))
    b = strip(current.get("tiertrain_model", current))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a.get(k)!r} vs this run {b.get(k)!r}" for k in diff[:4])
        raise CheckpointError(
            f"checkpoint {ckpt} is from a different model ({detail}); "
            "resume with the model it was saved from, or start a new run in another --out"
        )


def _checked_weights(ckpt: Path, ts: TrainState) -> LazyTensors:
    """The saved weights, read one tensor at a time as they are loaded, after their names and shapes are checked."""
    tensors = LazyTensors(ckpt / "model.safetensors")
    expected = ts.expected_weights()
    if set(tensors) != set(expected) or any(tensors.shape(k) != tuple(expected[k]) for k in expected):
        raise CheckpointError(f"weights in {ckpt} do not match this model's parameters; resume the model they came from")
    return tensors


def _restore_rng(ckpt: Path, plain: dict[str, Any]) -> None:
    tensors = _load_tensors(ckpt / "rng.safetensors")
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    np_state = plain["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))
    py = plain["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def load_checkpoint(ckpt: Path, ts: TrainState) -> TrainerState:
    """Restore model, optimizer and RNG from ``ckpt`` after verifying it; return the rest."""
    trainer = _read_json(ckpt / "trainer.json")
    if trainer.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt} has format {trainer.get('format_version')}, this tiertrain reads {FORMAT_VERSION}")
    _verify_files(ckpt, trainer["files"])
    check_same_model(ckpt, ts.module)
    ts.load(_checked_weights(ckpt, ts), LazyTensors(ckpt / "optimizer.safetensors"), trainer["param_groups"])
    _restore_rng(ckpt, trainer["rng"])
    return TrainerState(step=trainer["step"], data_position=trainer["data_position"],
                        scaler=trainer["scaler"], run_config=trainer["run_config"])
