"""``bench description``: how far a machine description alone predicts this machine's steps.

Planning for hardware you do not have rests on its description: the planner sees only its rates,
and block times come from FLOPs and bytes at those rates (no block is run). Here the description is
this machine's own, probed fresh each round (or read from ``--machine FILE``), and each of three plans
of different character (all resident; streamed through a window with states on the host; states on
disk) is predicted from it and then run, in the same round: the figure is predicted over measured.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Callable

from tiertrain.bench.planner import _Run, fidelity_plans
from tiertrain.bench.runtime import model_cfg
from tiertrain.measure.analytic import analytic_profile
from tiertrain.measure.machine import probe
from tiertrain.memory import Budgets
from tiertrain.models import param_count
from tiertrain.plan import Plan, builtin_plan
from tiertrain.planner.machine import Machine
from tiertrain.planner.simulator import simulate

MiB = 1 << 20


def description_plans(layers: int) -> dict[str, Plan]:
    return {"resident": builtin_plan("resident", layers), "stream": builtin_plan("stream", layers),
            "disk-homed": fidelity_plans(layers, disk=True)["disk-homed"]}


def bench_description(d: int, layers: int, batch: int, seq: int, steps: int, disk_dir: str | None,
                      out: Callable[[str], None], machine_file: str | None = None, rounds: int = 3) -> dict:
    cfg = model_cfg(d, layers, max(256, seq))
    run, page = _Run(cfg, batch, seq), MiB
    directory = Path(disk_dir or tempfile.mkdtemp(prefix="tiertrain-bench-", dir="."))
    room = max(256 * MiB, 64 * param_count(cfg))
    budgets = Budgets(device=room, host=room, disk=room, disk_dir=str(directory))
    plans = description_plans(layers)
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in plans}
    for r in range(rounds):
        machine = Machine.read(Path(machine_file)) if machine_file else probe(str(directory), use_cache=False)
        profile = dataclasses.replace(analytic_profile(cfg, batch, seq, "fp32", machine=machine), page=page)
        if r == 0:
            out(f"model {param_count(cfg) / 1e6:.1f}M params ({layers} blocks, d {d}), batch {batch} x {seq}, fp32; "
                f"profile: {profile.source}")
        for name, plan in plans.items():
            times, _, _ = run.measure(plan, budgets, page, steps)
            rows[name].append((simulate(plan, profile).step_s, statistics.median(times)))
    if disk_dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    results = {}
    for name, per_round in rows.items():
        ratios = [p / m for p, m in per_round]
        predicted, measured = (statistics.median(x[k] for x in per_round) for k in (0, 1))
        results[name] = {"predicted_s": predicted, "measured_s": measured, "ratios": ratios}
        out(f"{name:10s} predicted {predicted * 1e3:8.1f} ms from the description, measured {measured * 1e3:8.1f} ms: "
            f"predicted/measured {statistics.median(ratios):.2f} (median of {rounds} rounds, {min(ratios):.2f}-"
            f"{max(ratios):.2f})")
    return results
