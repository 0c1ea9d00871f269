"""Local ranks for the benchmarks that need several processes: ``torchrun --standalone`` on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def torchrun(nproc: int, args: list[str], threads: int, timeout: float) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` over ``nproc`` local ranks each running ``python args`` with ``threads``
    threads, output captured. Its agent's logs go to a temporary directory removed afterwards (torchrun
    leaves one per launch in TMPDIR otherwise)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="tiertrain-torchrun-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--log-dir={logs}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
