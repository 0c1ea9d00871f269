"""STRONGHOLD's multi-stream execution inside one device (issue 40's deliverable 3), measured: the same GPT,
batches and plan with every block over 1, 2 and 4 streams in one run, the step time of each beside one
stream's, and their losses: over n streams against the same n chunks issued on one stream (bit for bit:
``runtime.streams``), and against the whole batch on one stream (fp32 rounding).

On a CPU the chunks run in turn (there are no streams), so the figures there say only what the chunking
costs; the gain is a GPU's, where one stream leaves the device idle.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

STREAMS = (1, 2, 4)


@dataclass(frozen=True)
class StreamsBench:
    d_model: int = 512
    layers: int = 8
    rows: int = 8
    seq: int = 128
    steps: int = 4            # timed, after one warm-up step
    plan: str = "resident"    # resident (states on the device), stream or max-offload


@contextmanager
def one_stream() -> Iterator[None]:
    """Every chunk issued on the step's own stream: the order n streams are checked against."""
    from tiertrain.runtime import hooks
    from tiertrain.runtime.streams import OneStream

    made = hooks.streams_for
    hooks.streams_for = lambda n, device: OneStream()
    try:
        yield
    finally:
        hooks.streams_for = made


def _run(b: StreamsBench, n: int, disk: str) -> tuple[list[float], list[float]]:
    """Seconds and loss of each step of ``b.plan`` with every block over ``n`` streams (the first step
    untimed)."""
    import tiertrain
    from tiertrain.bench.runtime import model_cfg
    from tiertrain.memory import Budgets
    from tiertrain.memory.system import compute_device
    from tiertrain.models import build
    from tiertrain.plan import builtin_plan
    from tiertrain.planner.streams import with_streams
    from tiertrain.train.objective import lm_loss

    device = compute_device()
    torch.manual_seed(0)
    model = build(dataclasses.replace(model_cfg(b.d_model, b.layers, b.seq), tie_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = 20 * sum(p.numel() for p in model.parameters()) + (1 << 30)
    plan = with_streams(builtin_plan(b.plan, b.layers), n)
    tm, topt = tiertrain.setup(model, opt, Budgets(budget, budget, 4 * budget, disk), plan=plan)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    seconds, losses = [], []
    try:
        for _ in range(1 + b.steps):
            x = torch.randint(0, 256, (b.rows, b.seq + 1), generator=g).to(device)
            sync()
            t0 = time.perf_counter()
            loss = lm_loss(tm, x[:, :-1], x[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    return seconds[1:], losses


def bench_streams(b: StreamsBench, echo: Callable[[str], None]) -> dict[int, dict[str, float]]:
    """Each stream count's median step, its ratio to one stream's, and whether its losses equal its chunks
    on one stream's (and how far the whole batch's are)."""
    out: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tiertrain-streams-") as disk:
        one_s, whole = _run(b, 1, disk)
        for n in STREAMS:
            seconds, losses = (one_s, whole) if n == 1 else _run(b, n, disk)
            with one_stream():
                _, chunks = _run(b, n, disk) if n > 1 else (None, whole)
            step = statistics.median(seconds)
            off = max(abs(a - w) / abs(w) for a, w in zip(losses, whole))
            out[n] = {"step_s": step, "vs_one": step / statistics.median(one_s), "exact": losses == chunks,
                      "off_whole": off}
            echo(f"{n} stream{'s' if n > 1 else ''}: {step * 1e3:.1f} ms a step ({out[n]['vs_one']:.2f}x one "
                 f"stream's); losses {'equal' if losses == chunks else 'DIFFER FROM'} the same chunks on one stream, "
                 f"{off:.1e} relative from the whole batch's")
    return out
