from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Measured page sizes are cached per machine; tests must not write into the user's cache.
import tempfile  # noqa: E402

if "TIERTRAIN_CACHE_DIR" not in os.environ:  # this run's own cache, removed as it ends (ranks it starts inherit it)
    os.environ["TIERTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tiertrain-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TIERTRAIN_CACHE_DIR"], ignore_errors=True)

# Every collective is held to its side (device-tier tensors to the device group, host memory to the CPU
# group: ``tiertrain.parallel.placement``), in this process and in every rank it starts.
os.environ["TIERTRAIN_CHECK_COLLECTIVES"] = "1"

REPO = Path(__file__).resolve().parents[1]


def at_one_thread(fn):
    """``fn`` run at one thread, as ``dp_harness.run_ranks``' ranks each run: a one-process reference held
    bit for bit against ranks must sum its matmuls as they do (some CPUs' BLAS splits a sum another way at
    two threads than at one)."""
    @functools.wraps(fn)
    def one_thread(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return one_thread


def load_meter(others: dict):
    """A ``LoadMeter`` stand-in: each measurement ran while others took ``others["cores"]`` of 2 cores."""
    from tiertrain.planner.machine import Load

    class Meter:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.load = Load(others_cores=others["cores"], cores=2)

    return Meter


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real ``tiertrain`` command in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "tiertrain.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def needs(blocks, plan, page: int, train: bool = True, transient_grads: bool = False) -> dict:
    """What ``plan.fit`` counts per tier for a model's blocks (gradients updated away as they come where
    ``transient_grads``, else all of them held)."""
    from tiertrain.plan.fit import tier_bytes
    from tiertrain.runtime.blocks import block_sizes

    return tier_bytes(block_sizes(blocks), plan, page, train, "transient" if transient_grads else "all")


def made(directory: Path) -> Path:
    """``directory``, made (tiertrain creates a disk directory only inside one that exists)."""
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def train_losses(tm, topt, batches) -> list[float]:
    """A plain loop over ``batches`` (token rows: inputs then next-token targets) through a tiered
    model; its losses. The runtime is closed afterwards."""
    from tiertrain.train.objective import lm_loss

    losses = []
    try:
        for b in batches:
            loss = lm_loss(tm, b[:, :-1], b[:, 1:])  # our GPT or a transformers model
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    return losses


def tiny_config(out: Path, **kw):
    from tiertrain.train.config import TrainConfig

    base = dict(model="tiny", steps=6, batch_size=4, seq_len=32, lr=3e-3, out=str(out), log_every=1000)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return path
