"""Pipeline schedules side by side (issue 38's benchmark): pp = 2 x dp = 2, the same model, batches and
plan under 1F1B, interleaved 1F1B and AIAO, in one run: step time and exposed DP.sync per schedule.

The two pipelines' ranks are laid out as two "hosts" (ranks 0-1 and 2-3: each pipeline inside a host, its
stages' data-parallel replicas across them), so every gradient reduction crosses between the hosts. With
``--rate`` (root, iproute2) the hosts are two network namespaces joined by a veth pair whose ends are
rate-limited by a token bucket (``tc tbf``: these kernels have no netem), as scripts/two_nodes.sh makes
them for the shell benchmarks; without it the ranks share the loopback.

Exposed DP.sync is the time each rank's step thread waited for its stages' gradient reductions to land
(``runtime.step_clock.StepClock.sync_wait_s``: in backward, and where a block's next use waits for a
reduction the step left in flight): what the schedule failed to hide under compute. With
``--plan stream`` or ``max-offload`` (states on the host, or on disk) each block is updated on the CPU
workers as its reduction lands (the overlap update mode), under the other segments' compute; a block's
next use waiting for both counts only the part before its reduction landed as exposed DP.sync (the rest is
the update's own time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tiertrain.bench.ranks import torchrun

SCHEDULES = ("1f1b", "interleaved", "aiao")
WORLD, PP = 4, 2


@dataclass(frozen=True)
class PipelineBench:
    d_model: int = 512
    layers: int = 8
    rows: int = 8             # per data-parallel replica and step, split into the micro-batches
    seq: int = 32
    micro: int = 4
    segments: int = 2         # interleaved's virtual stages per rank and AIAO's segments (1F1B holds one)
    steps: int = 4            # timed, after one warm-up step
    threads: int = 1          # per rank
    plan: str = "resident"    # or stream (states on the host), max-offload (on disk, updated on CPU workers)
    schedules: tuple[str, ...] = SCHEDULES


def run_schedule(schedule: str, b: PipelineBench, disk: Path) -> dict[str, Any]:
    """This rank's timed steps of one schedule: seconds per step and seconds waited for DP.sync."""
    import torch.distributed as dist

    from tiertrain.api.pipeline import pipeline
    from tiertrain.bench.runtime import model_cfg
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.plan.pipeline import PipelineLayout

    torch.manual_seed(0)
    model = build(dataclasses.replace(model_cfg(b.d_model, b.layers), tie_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    budget = 16 * sum(p.numel() for p in model.parameters()) + (256 << 20)
    layout = PipelineLayout(pp=PP, schedule=schedule, micro_batches=b.micro,
                            segments=1 if schedule == "1f1b" else b.segments)
    on_disk = b.plan == "max-offload"
    memory = Budgets(budget, budget, 4 * budget if on_disk else 0, str(disk) if on_disk else None)
    run = pipeline(model, opt, layout, memory, plan=b.plan, update="overlap" if b.plan != "resident" else "sync")
    g = torch.Generator().manual_seed(1 + dist.get_rank() // PP)
    steps, waits, computed, updates, busy = [], [], [], [], [0.0]
    try:
        for step in range(1 + b.steps):
            x = torch.randint(0, 256, (b.rows, b.seq + 1), generator=g)
            dist.barrier()
            t0, w0, c0 = time.perf_counter(), _waited(run), busy[0]
            run.step(x[:, :-1], x[:, 1:])
            t1, w1 = time.perf_counter(), _waited(run)
            run.optimizer.step()
            run.optimizer.zero_grad()
            t2 = time.perf_counter()
            dist.barrier()
            if step:
                steps.append(time.perf_counter() - t0)
                waits.append(_waited(run) - w0)
                computed.append(busy[0] - c0 - (w1 - w0))
                updates.append(t2 - t1 - (_waited(run) - w1))  # the step's own work, less its reductions landing
            else:  # torch's stages exist once the first step made them
                _time_compute(run, busy)
        params = sum(p.numel() for s in run.stages for p in s.parameters())
    finally:
        run.close()
    return {"step_s": steps, "sync_s": waits, "compute_s": computed, "update_s": updates, "params": params}


def _time_compute(run: Any, busy: list[float]) -> None:
    """Add each of torch's stages' forward and backward calls' seconds to ``busy[0]`` (the backward's include
    the waits for reductions landing in it, which the caller takes away)."""
    schedule = run._schedule
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            call = getattr(stage, name)

            def timed(*args: Any, _call: Callable = call, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _call(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - t0
            setattr(stage, name, timed)


def _waited(run: Any) -> float:
    return sum(s.runtime.clock.sync_wait_s for s in run.stages)


def worker(b: PipelineBench, out: Path) -> None:
    """One rank (its process group from the environment): every schedule, its figures to ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(b.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        figures: dict[str, Any] = {"link_bps": _replicas_rate()}
        figures |= {s: run_schedule(s, b, out) for s in b.schedules}
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(figures))


def _replicas_rate(nbytes: int = 32 << 20, rounds: int = 3) -> float:
    """Bytes a rank sends per second in an all-reduce with its stage's other replica (across the hosts) while
    the other stage's replicas all-reduce too: the best of ``rounds``. The two hosts have one link, which
    every stage's sync shares where they run at once (1F1B's do; measured alone, one stage's reached 0.96 of
    the veth's 1 Gbit/s, beside the other's 0.48)."""
    import torch.distributed as dist

    groups = [dist.new_group([r, r + PP]) for r in range(PP)]  # every rank makes every group, in one order
    mine = groups[dist.get_rank() % PP]
    t, best = torch.zeros(nbytes // 4), float("inf")
    for _ in range(rounds):  # every stage's replicas at once: the hosts' one link shared, as 1F1B's syncs share it
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t, group=mine)
        best = min(best, time.perf_counter() - t0)
    for g in groups:
        dist.destroy_process_group(g)
    return nbytes / best  # a ring all-reduce of two ranks sends the buffer once


def launch(b: PipelineBench, rate: str | None, out: Path) -> None:
    """The four ranks: on the loopback under torchrun, or (``rate``) two per namespace over the veth."""
    args = ["-m", "tiertrain.bench.pipeline", "--worker", str(out), "--config", json.dumps(dataclasses.asdict(b))]
    env = {**os.environ, "OMP_NUM_THREADS": str(b.threads), "PYTHONUNBUFFERED": "1"}
    if rate is None:
        done = torchrun(WORLD, args, b.threads, 1800)
        if done.returncode:
            raise RuntimeError(f"the pipeline benchmark's ranks failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return
    with TwoHosts(rate) as hosts:
        procs = [hosts.start(rank, rank // PP, [sys.executable, *args], env, out / f"log{rank}") for rank in range(WORLD)]
        failed = _wait_all(procs, time.monotonic() + 1800)
        if failed:
            logs = "\n".join((out / f"log{r}").read_text()[-2000:] for r in failed)
            raise RuntimeError(f"ranks {failed} of the pipeline benchmark failed:\n{logs}")


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int]:
    """The ranks that failed (or outlived ``deadline``); once one has, the others are not waited for."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
            return [r for r, c in enumerate(codes) if c is not None and c != 0]
        time.sleep(0.2)
    return [r for r, p in enumerate(procs) if p.poll() is None]


class TwoHosts:
    """Two network namespaces joined by a rate-limited veth pair, removed (with what runs in them) on exit."""

    SUBNET, PORT = "10.78.0", 29631

    def __init__(self, rate: str) -> None:
        tag = os.getpid()
        self.rate, self.ns, self.dev = rate, [f"tt-pp{k}-{tag}" for k in (0, 1)], [f"ttp{k}-{tag}" for k in (0, 1)]

    def __enter__(self) -> "TwoHosts":
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for k in (0, 1):
                _ip("link", "set", self.dev[k], "netns", self.ns[k])
                _ip("-n", self.ns[k], "addr", "add", f"{self.SUBNET}.{k + 1}/24", "dev", self.dev[k])
                _ip("-n", self.ns[k], "link", "set", "lo", "up")
                _ip("-n", self.ns[k], "link", "set", self.dev[k], "up")
                subprocess.run(["tc", "-n", self.ns[k], "qdisc", "add", "dev", self.dev[k], "root", "tbf", "rate",
                                self.rate, "burst", "256kb", "latency", "50ms"], check=True, capture_output=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self, rank: int, host: int, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        env = {**env, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": f"{self.SUBNET}.1",
               "MASTER_PORT": str(self.PORT), "GLOO_SOCKET_IFNAME": self.dev[host]}
        with open(log, "w") as f:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], env=env, stdout=f,
                                    stderr=subprocess.STDOUT)

    def __exit__(self, *exc: object) -> None:
        for ns in self.ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the veth with it
        subprocess.run(["ip", "link", "del", self.dev[0]], capture_output=True)  # one never moved into its namespace


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def report(out: Path, b: PipelineBench, rate: str | None, echo: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Per schedule: the median step (the slowest rank's, each step), the ranks' mean exposed DP.sync, and
    both against 1F1B's."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    link = (f"veth between two namespaces, tbf {rate} (a stage's all-reduce across, beside the other's, reached "
            f"{statistics.median(r['link_bps'] for r in ranks) * 8 / 1e9:.2f} Gbit/s)" if rate else
            "loopback (no rate limit)")
    echo(f"pp {PP} x dp {WORLD // PP}, {b.layers} blocks of d_model {b.d_model}, {b.rows} rows x {b.seq} tokens per "
         f"replica in {b.micro} micro-batches, {b.segments} segments (AIAO, interleaved), plan {b.plan}; link: {link}; "
         f"{b.steps} timed steps")
    rows = {}
    for s in b.schedules:
        step = statistics.median(max(r[s]["step_s"][k] for r in ranks) for k in range(b.steps))
        sync = statistics.median(statistics.fmean(r[s]["sync_s"][k] for r in ranks) for k in range(b.steps))
        rows[s] = {"step_s": step, "sync_s": sync, "predicted_s": _predicted(s, ranks, b, rate)}
    base = rows.get("1f1b")
    for s, row in rows.items():
        vs = "" if base is None or s == "1f1b" else (
            f"   vs 1F1B: {base['step_s'] / row['step_s']:.2f}x throughput, exposed DP.sync "
            f"{_less(row['sync_s'], base['sync_s'])}")
        echo(f"{s:12s} step {row['step_s'] * 1e3:8.1f} ms   exposed DP.sync {row['sync_s'] * 1e3:7.1f} ms "
             f"({row['sync_s'] / row['step_s']:.0%} of the step){vs}")
        if row["predicted_s"] is not None:
            echo(f"{'':12s} FOLD3D's model predicts {row['predicted_s'] * 1e3:8.1f} ms "
                 f"(measured / predicted {row['step_s'] / row['predicted_s']:.2f})")
    return rows


def _predicted(schedule: str, ranks: list[dict], b: PipelineBench, rate: str | None) -> float | None:
    """FOLD3D's step (``planner.fold3d``) from what was measured: the busiest rank's compute (its stages'
    forward and backward calls, less its waits for reductions), its gradients' all-reduce over the 2
    replicas at the rate an all-reduce between them reached before the run (``_replicas_rate``), the
    stages' sends inside a host taken as free (the loopback), and its optimizer step, which no schedule
    overlaps here (FOLD3D's ``T_ip``: what never overlaps). None without a rate limit (on the loopback the
    ranks' cores, not a link, bound the reductions)."""
    from tiertrain.planner.fold3d import StageTimes, aiao_s, one_f_one_b_s

    if rate is None:
        return None
    k = max(range(len(ranks)), key=lambda r: statistics.median(ranks[r][schedule]["compute_s"]))
    compute = statistics.median(ranks[k][schedule]["compute_s"])
    update = statistics.median(ranks[k][schedule]["update_s"])
    dp_sync = 4 * ranks[k][schedule]["params"] / ranks[k]["link_bps"]  # fp32 gradients: one buffer sent
    ns = 1 if schedule == "1f1b" else b.segments
    t = StageTimes(compute, dp_sync, 0.0, PP, b.micro, other_s=update)
    return aiao_s(t, ns) if schedule == "aiao" else one_f_one_b_s(t, ns)


def link_bytes_per_s(rate: str) -> float:
    """A ``tc`` rate ("1gbit", "100mbit", "500kbit", "2mbps") in bytes per second."""
    units = {"gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8, "bit": 1 / 8, "gbps": 1e9, "mbps": 1e6, "kbps": 1e3,
             "bps": 1.0}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"--rate {rate!r}: give a tc rate such as 1gbit, 100mbit or 500kbit")


def _less(mine: float, theirs: float) -> str:
    if theirs <= 0:
        return "n/a (1F1B exposed none)"
    return f"{1 - mine / theirs:.0%} less" if mine <= theirs else f"{mine / theirs - 1:.0%} more"


def bench_pipeline(b: PipelineBench, rate: str | None, echo: Callable[[str], None]) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="tiertrain-bench-pipeline-") as tmp:
        launch(b, rate, Path(tmp))
        return report(Path(tmp), b, rate, echo)


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--config", required=True)
    a = p.parse_args()
    given = json.loads(a.config)
    worker(PipelineBench(**{**given, "schedules": tuple(given["schedules"])}), Path(a.worker))


if __name__ == "__main__":
    _main()
