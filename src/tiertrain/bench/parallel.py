"""Data parallel on this machine: dp = N against dp = 1 with the same per-rank batch, the communication
a rank's loop waits for, and the bytes each rank sends per step.

Every configuration runs under ``torchrun`` (dp = 1 too, so both pay the same process start and run
the same code path), each rank with ``cores / N`` threads at both sizes, so a rank computes as fast at
dp = N as the single rank does at dp = 1 and the difference is communication, the ranks waiting for
each other, and the memory bandwidth they share. Exposed communication is the time the training loop's thread is blocked in a collective (a
synchronous call, or waiting on an asynchronous all-gather), counted by wrapping the runtime's
collectives; what the collectives took in all is estimated from the bytes sent at the link's bandwidth,
measured in the same run (a 32 MiB all-reduce). Bytes sent per step are printed against the layouts'
volumes in units of (N-1)/N x the parameters' bytes: 2 for DDP- and ZeRO-2-like layouts, and for
ZeRO-3-like 1 for the gradients, 1 for what stays on the device, and one gather per slot fetch of a
streamed block (3 where every block is fetched twice; tests/test_data_parallel.py holds the exact count).

``--master-addr``/``--nnodes`` style runs over a real (or emulated) link: launch the worker under your
own ``torchrun`` with ``python -m tiertrain.bench.parallel --worker ...`` on each node.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tiertrain.bench.ranks import torchrun

LAYOUTS = ("ddp", "zero2", "zero3")
DESCRIBE = {"ddp": "DDP-like (resident, replicated)", "zero2": "ZeRO-2-like (resident, sharded)",
            "zero3": "ZeRO-3-like (stream, sharded)"}
RESULT = "tiertrain-bench-parallel "


@dataclass(frozen=True)
class ParallelBench:
    d_model: int = 512
    layers: int = 6
    batch: int = 4          # per rank
    seq: int = 128
    steps: int = 5          # timed, after 2 warm-up steps
    threads: int = 1        # per rank, at dp = 1 too: cores / N, so a rank computes alike at both sizes


def _plan(layout: str, n_blocks: int, world: int) -> Any:
    from tiertrain.plan import builtin_plan, data_parallel

    base = builtin_plan("stream" if layout == "zero3" else "resident", n_blocks)
    return base if world == 1 else data_parallel(base, world, shard=layout != "ddp")


class _Blocked:
    """Time the loop's thread spends inside the collectives (other threads' calls are not the loop's
    wait: an overlap update gathering on a worker hides behind backward)."""

    def __init__(self, comm: Any) -> None:
        self.seconds = 0.0
        for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
            setattr(comm, name, self._timed(getattr(comm, name)))

    def _add(self, t0: float) -> None:
        if threading.current_thread() is threading.main_thread():
            self.seconds += time.perf_counter() - t0

    def _timed(self, call: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            work = call(*args, **kwargs)
            self._add(t0)
            return work if work is None else _TimedWait(work, self)
        return timed


class _TimedWait:
    def __init__(self, work: Any, blocked: _Blocked) -> None:
        self.work, self.blocked = work, blocked

    def wait(self) -> None:
        t0 = time.perf_counter()
        self.work.wait()
        self.blocked._add(t0)


def _link_bps() -> float:
    """Bytes a rank sends per second in a ring all-reduce of 32 MiB (best of 3): the link as gloo uses it."""
    import torch.distributed as dist

    from tiertrain.parallel.collectives import ring_bytes

    t = torch.ones(8 << 20)
    dist.all_reduce(t)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        best = min(best, time.perf_counter() - t0)
    return ring_bytes("all_reduce", t.numel() * 4, dist.get_world_size()) / best


def _leave_group() -> None:
    """Every rank leaves the group together: a rank exiting while gloo's threads still serve the other's
    last messages aborted ("terminate called without an active exception") in one run of four."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def worker(layout: str, b: ParallelBench) -> dict[str, Any]:
    """One rank's run (under torchrun): step times, blocked seconds and bytes sent per timed step."""
    import tiertrain
    from tiertrain.bench.runtime import model_cfg
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.parallel import rank_from_env, world_from_env

    world, rank = world_from_env(), rank_from_env()
    torch.set_num_threads(b.threads)
    torch.manual_seed(0)
    model = build(model_cfg(b.d_model, b.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    budget = 16 * sum(p.numel() for p in model.parameters()) + (256 << 20)
    tm, topt = tiertrain.setup(model, opt, Budgets(budget, budget), plan=_plan(layout, b.layers, world))
    rt = tm.runtime
    link = _link_bps() if world > 1 else 0.0
    blocked = _Blocked(rt.comm)
    g = torch.Generator().manual_seed(1 + rank)
    rows = []
    try:
        for step in range(2 + b.steps):
            x = torch.randint(0, 256, (b.batch, b.seq + 1), generator=g)
            t0, w0, s0 = time.perf_counter(), blocked.seconds, getattr(rt.comm, "sent", 0)
            lm_loss(tm, x[:, :-1], x[:, 1:]).backward()
            topt.step()
            topt.zero_grad()
            fetched = rt.cache.pop_fetches()
            if step >= 2:
                rows.append((time.perf_counter() - t0, blocked.seconds - w0, getattr(rt.comm, "sent", 0) - s0, fetched))
        params = sum(gr.layout.numel for gr in rt.groups)
        streamed = [gr.layout.numel for gr in rt.groups if gr.plan.stream]
    finally:
        rt.close()
        rt.mem.close()
        _leave_group()
    return {"step_s": [r[0] for r in rows], "blocked_s": [r[1] for r in rows], "sent": [r[2] for r in rows],
            "fetches": [r[3] for r in rows], "params": params, "streamed": sum(streamed),
            "streamed_block": max(streamed, default=0), "world": world, "threads": torch.get_num_threads(),
            "link_bps": link}


def _launch(layout: str, world: int, b: ParallelBench) -> dict[str, Any]:
    done = torchrun(world, ["-m", "tiertrain.bench.parallel", "--worker", "--layout", layout, "--config",
                            json.dumps(dataclasses.asdict(b))], b.threads, 900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"dp={world} {layout} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def bench_parallel(b: ParallelBench, world: int, layouts: tuple[str, ...], rounds: int,
                   echo: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """dp = 1 and dp = ``world`` alternated per round for each layout; medians over rounds and steps."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for layout in layouts:
            for w in (1, world):
                runs.setdefault((layout, w), []).append(_launch(layout, w, b))
        echo(f"round {r + 1}/{rounds} done")
    return {layout: _report(layout, runs[(layout, 1)], runs[(layout, world)], world, echo) for layout in layouts}


def _report(layout: str, one: list[dict], many: list[dict], world: int, echo: Callable[[str], None]) -> dict:
    def med(runs: list[dict], key: str) -> float:
        return statistics.median(v for run in runs for v in run[key])

    t1, tn, blocked = med(one, "step_s"), med(many, "step_s"), med(many, "blocked_s")
    sent, link = med(many, "sent"), statistics.median(run["link_bps"] for run in many)
    params, streamed = 4 * many[0]["params"], 4 * many[0]["streamed"]
    unit = params * (world - 1) / world
    # gradients: all-reduced (2 units) or reduce-scattered (1) and the device-kept blocks gathered after
    # their update (1); a streamed block instead gathered at each slot fetch (forward, and again in
    # backward where the window did not keep it)
    fetched = med(many, "fetches") * 4 * many[0]["streamed_block"]
    volume = 2.0 if layout != "zero3" else 1 + (params - streamed + fetched) / params
    comm = sent / link if link else 0.0
    hidden = 1 - blocked / comm if comm > blocked else 0.0
    spread = [min(v for run in many for v in run["step_s"]), max(v for run in many for v in run["step_s"])]
    echo(f"{DESCRIBE[layout]}: dp=1 step {t1 * 1e3:.0f} ms, dp={world} step {tn * 1e3:.0f} ms "
         f"(min {spread[0] * 1e3:.0f}, max {spread[1] * 1e3:.0f}; {many[0]['threads']} thread(s) per rank): "
         f"dp={world}/dp=1 {tn / t1:.2f}")
    echo(f"  sent per rank per step {sent / 1e6:.1f} MB = {sent / unit:.3f} x (N-1)/N x params bytes "
         f"(volume {volume:.3f} for the gradients and gathers; the rest: has-gradient flags)")
    echo(f"  communication: {comm * 1e3:.0f} ms at the link's {link / 1e9:.2f} GB/s; the loop blocked "
         f"{blocked * 1e3:.0f} ms = {blocked / tn:.1%} of the step exposed, {hidden:.0%} of it hidden")
    return {"dp1_s": t1, "dpn_s": tn, "exposed_fraction": blocked / tn, "hidden": hidden, "sent": sent}


def report_file(path: str, echo: Callable[[str], None] = print) -> None:
    """Runs launched by hand (``scripts/slow_link_bench.sh``), one per line: ``LAYOUT WORLD RESULT-JSON``."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for line in open(path, encoding="utf-8"):
        layout, world, result = line.split(" ", 2)
        runs.setdefault((layout, int(world)), []).append(json.loads(result))
    for layout in LAYOUTS:
        many = [w for (name, w) in runs if name == layout and w > 1]
        if (layout, 1) in runs and many:
            _report(layout, runs[(layout, 1)], runs[(layout, many[0])], many[0], echo)


def main(argv: list[str] | None = None) -> None:
    """The worker's entry under torchrun (``tiertrain bench parallel`` launches it), or ``--report``."""
    p = argparse.ArgumentParser(prog="python -m tiertrain.bench.parallel")
    p.add_argument("--report", help="print the figures of runs recorded in this file")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--layout", choices=LAYOUTS)
    p.add_argument("--config", default="{}", help="ParallelBench fields as JSON")
    a = p.parse_args(argv)
    if a.report:
        report_file(a.report)
        return
    if not (a.worker and a.layout):
        p.error("give --worker --layout L (under torchrun), or --report FILE")
    from tiertrain import typed

    b = typed.load(ParallelBench, json.loads(a.config), "bench parallel config")
    out = worker(a.layout, b)
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
