"""A pipeline of 2 stages, each rank a process in its own cgroup v1 memory cap, training a GPT whose fp32
weights alone exceed either cap (so no rank may build it whole: each builds it on the meta device and draws
only its stages) and whose states are over twice the two caps together (homed on disk): the proof, on a CPU machine
as root, that a model larger than one host's memory is cut into stages and trains.

    sudo .venv/bin/python scripts/pipeline_under_cgroups.py [WORKDIR]

Prints each rank's cgroup peak beside its cap, the losses, and the states' size; exits non-zero if a rank
failed or went over. Not a test (it takes a minute or two and 12 GB of disk); benchmarks.md keeps its figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tiertrain.memory import Tier
from tiertrain.models import ModelConfig, param_count
from tiertrain.plan import BlockPlan, Plan

# sync updates hold a stage's every gradient on the host through the step (a pipeline's last backward ends
# before the step): the host budget holds one stage's (48 blocks x 28 MB); the overhead as tests/test_cgroup.py
DEVICE, HOST, OVERHEAD = 128 << 20, 1792 << 20, 368 << 20
CAP = DEVICE + HOST + OVERHEAD
LAYERS = 96
MODEL = ModelConfig(n_layer=LAYERS, n_head=12, d_model=768, d_ffn=3072, vocab_size=256, max_seq_len=64, name="cgroup")
PLAN = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in range(LAYERS)), BlockPlan(home=Tier.DISK),
            window=2, prefetch=1, update="sync", read_ahead=1, update_workers=1, name="disk-home")


def cgroup(name: str) -> Path:
    group = Path("/sys/fs/cgroup/memory") / f"tiertrain-pp-{os.getpid()}-{name}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(CAP))
    return group


def main(work: Path) -> int:
    n = param_count(MODEL)
    print(f"model {n / 1e6:.0f}M params: fp32 weights {4 * n / 2**30:.2f} GiB, states {16 * n / 2**30:.1f} GiB; "
          f"each rank's cap {CAP / 2**20:.0f} MiB (budgets {(DEVICE + HOST) >> 20} MiB + overhead {OVERHEAD >> 20} MiB)")
    (work / "model.json").write_text(json.dumps(MODEL.to_dict()))
    (work / "plan.json").write_text(PLAN.to_json())
    out = work / "run"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29400 + os.getpid() % 500),
           "PYTHONUNBUFFERED": "1"}
    args = ["train", "--model", str(work / "model.json"), "--plan", str(work / "plan.json"), "--pp", "2",
            "--schedule", "gpipe", "--micro-batches", "1", "--grad-clip", "0", "--device-memory", f"{DEVICE >> 20}MiB",
            "--host-memory", f"{HOST >> 20}MiB", "--page-size", "1MiB", "--batch-size", "1", "--seq-len", "32",
            "--steps", "2", "--no-save", "--out", str(out), "--disk", f"{work / 'disk'}:6GiB"]
    groups = [cgroup(f"rank{r}") for r in range(2)]
    try:
        procs = []
        for rank, group in enumerate(groups):
            cmd = f'echo $$ > {group}/cgroup.procs && exec "{sys.executable}" -m tiertrain ' + " ".join(
                f'"{a}"' for a in args)
            procs.append(subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        results = [p.communicate(timeout=1800) for p in procs]
        peaks = [int((g / "memory.max_usage_in_bytes").read_text()) for g in groups]
    finally:
        for g in groups:
            g.rmdir()
    ok = all(p.returncode == 0 for p in procs)
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, results)):
        print(f"rank {rank}: exit {p.returncode}, cgroup peak {peaks[rank] / 2**20:.0f} MiB of {CAP / 2**20:.0f} MiB")
        if p.returncode:
            print(stdout[-2000:], stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if ok else []
    print("losses", [round(r["loss"], 4) for r in rows], "meta build:", "building it on the meta device" in results[0][0])
    return 0 if ok and max(peaks) <= CAP and len(rows) == 2 else 1


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    work = Path(tempfile.mkdtemp(prefix="tiertrain-pp-cgroup-", dir=root))
    try:
        sys.exit(main(work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
