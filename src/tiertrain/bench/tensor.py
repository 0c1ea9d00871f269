"""Tensor parallel against one process (issue 39's benchmark): the same GPT, batches and plan at tp = 2 (two
ranks of one thread each, the loopback between them) and at tp = 1 (one process of two threads: the same
two cores), in one run: step time side by side, and the bytes each tp rank sent per step beside the formula;
with ``--sequence-parallel``, tp = 2 with the sequence sliced between the cut regions beside them too.

The formula: per block, two sums of the block's output activations (rows x tokens x d_model, fp32) in
forward and two in backward (``parallel.tensor_ops``), each a ring all-reduce that sends 2 (T-1)/T of
the buffer; a clipping step adds its norm. Sequence parallel: each sum an all-gather and a reduce-scatter
((T-1)/T each, the same bytes), backward gathering attention's and the MLP's input again (the column
layers keep their slices), the sequence gathered once before the final norm and once in backward as the
first block's input, and each block's whole parameters' gradients summed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiertrain.bench.ranks import torchrun

TP = 2


@dataclass(frozen=True)
class TensorBench:
    d_model: int = 512
    layers: int = 8
    rows: int = 8
    seq: int = 128
    steps: int = 4            # timed, after one warm-up step
    plan: str = "stream"      # resident, stream (states on the host) or max-offload (on disk)
    sequence: bool = False    # the sequence sliced between the cut regions (sequence parallel)

    @property
    def label(self) -> str:
        return "sp" if self.sequence else ""


def _setup(b: TensorBench, tp: int, disk: Path) -> tuple[Any, Any, Callable[[], int]]:
    """The model under ``b.plan``, cut over ``tp`` ranks where tp > 1 (else one process's plain setup), its
    optimizer, and what its tensor-parallel group has sent so far."""
    import tiertrain
    from tiertrain.bench.runtime import model_cfg
    from tiertrain.memory import Budgets
    from tiertrain.models import build

    torch.manual_seed(0)
    model = build(dataclasses.replace(model_cfg(b.d_model, b.layers, b.seq), tie_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    budget = 16 * sum(p.numel() for p in model.parameters()) + (256 << 20)
    on_disk = b.plan == "max-offload"
    memory = Budgets(budget, budget, 4 * budget if on_disk else 0, str(disk) if on_disk else None)
    if tp == 1:
        tm, topt = tiertrain.setup(model, opt, memory, plan=b.plan)
        return tm, topt, lambda: 0
    run = tiertrain.tensor_parallel(model, opt, tp, memory, plan=b.plan, sequence_parallel=b.sequence)
    return run.model, run.optimizer, lambda: run.mesh.tp_group.sent


def run(b: TensorBench, tp: int, disk: Path) -> dict[str, Any]:
    """This rank's timed steps: seconds each, bytes its group sent in each."""
    from tiertrain.train.objective import lm_loss

    model, opt, sent = _setup(b, tp, disk)
    g = torch.Generator().manual_seed(1)
    steps, sends = [], []
    try:
        for step in range(1 + b.steps):
            x = torch.randint(0, 256, (b.rows, b.seq + 1), generator=g)
            t0, s0 = time.perf_counter(), sent()
            lm_loss(model, x[:, :-1], x[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if step:
                steps.append(time.perf_counter() - t0)
                sends.append(sent() - s0)
    finally:
        model.runtime.close()
        model.runtime.mem.close()
    return {"step_s": steps, "sent": sends}


def worker(b: TensorBench, tp: int, out: Path) -> None:
    """One rank (its process group from the environment where tp > 1)."""
    import torch.distributed as dist

    if tp > 1:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank = dist.get_rank() if tp > 1 else 0
    try:
        figures = run(b, tp, out / f"disk{rank}")
    finally:
        if tp > 1:
            dist.destroy_process_group()
    (out / f"tp{tp}{b.label}-rank{rank}.json").write_text(json.dumps(figures))


def formula_bytes(b: TensorBench, tp: int) -> int:
    """What each rank's group sends per step (module docstring), with the clipping step's norm."""
    from tiertrain.bench.runtime import model_cfg
    from tiertrain.parallel.tensor_plans import whole_per_block

    act = b.rows * b.seq * b.d_model * 4
    if not b.sequence:
        return b.layers * 4 * 2 * (tp - 1) * act // tp + 4
    unit = (tp - 1) * act // tp
    whole = whole_per_block(model_cfg(b.d_model, b.layers, b.seq)) * 4 * 2 * (tp - 1) // tp
    return b.layers * (10 * unit + whole) + 2 * unit + 4  # 10: backward gathers the column layers' inputs again


def _ranks(b: TensorBench, tp: int, out: Path) -> list[dict[str, Any]]:
    """``b`` run at ``tp`` (tp ranks of one thread each; one process of TP threads at tp = 1): each rank's figures."""
    args = ["-m", "tiertrain.bench.tensor", "--worker", str(out), "--config", json.dumps(dataclasses.asdict(b))]
    done = torchrun(tp, [*args, "--tp", str(tp)], 1 if tp > 1 else TP, 1800)
    if done.returncode:
        raise RuntimeError(f"the tensor benchmark's ranks failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads((out / f"tp{tp}{b.label}-rank{r}.json").read_text()) for r in range(tp)]


def bench_tensor(b: TensorBench, echo: Callable[[str], None], sequence: bool = False) -> dict[str, float]:
    """tp = 2 beside tp = 1 (and, with ``sequence``, tp = 2 with sequence parallel) in one run."""
    cuts = [b, dataclasses.replace(b, sequence=True)] if sequence else [b]
    with tempfile.TemporaryDirectory(prefix="tiertrain-bench-tensor-") as tmp:
        ranks = [_ranks(c, TP, Path(tmp)) for c in cuts]
        one = _ranks(b, 1, Path(tmp))[0]
    alone = statistics.median(one["step_s"])
    echo(f"{b.layers} blocks of d_model {b.d_model}, {b.rows} rows x {b.seq} tokens a step, plan {b.plan}, fp32, "
         f"clipped; {b.steps} timed steps; the same {TP} cores either way")
    out = {"one_step_s": alone}
    for c, cut in zip(cuts, ranks):
        step = statistics.median(max(r["step_s"][k] for r in cut) for k in range(b.steps))
        sent, want = statistics.median(cut[0]["sent"]), formula_bytes(c, TP)
        name = f"tp {TP}{' + sequence parallel' if c.sequence else ''} (2 ranks x 1 thread)"
        echo(f"{name}: step {step * 1e3:8.1f} ms   sent per rank per step {sent:,.0f} B (formula {want:,} B: "
             f"{sent / want:.3f})   tp {TP} / tp 1: {step / alone:.2f}x the time")
        out.update({f"tp{c.label}_step_s": step, f"sent{c.label}": sent, f"formula{c.label}": want})
    echo(f"tp 1 (1 process x {TP} threads): step {alone * 1e3:8.1f} ms")
    return out


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--tp", type=int, required=True)
    a = p.parse_args()
    worker(TensorBench(**json.loads(a.config)), a.tp, Path(a.worker))


if __name__ == "__main__":
    sys.exit(_main())
