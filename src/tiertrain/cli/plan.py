"""``tiertrain plan``: the chosen plan per block, its prediction, and the other solvers' distance."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from tiertrain.errors import ConfigError
from tiertrain.planner.auto import Candidate
from tiertrain.planner.profile import Profile
from tiertrain.planner.simulator import RESOURCES, Simulation
from tiertrain.units import format_bytes


def print_plan(chosen: Candidate, cands: list[Candidate], profile: Profile, console: Console) -> None:
    plan, sim = chosen.plan, chosen.sim
    table = Table(title=f"plan {plan.name}: window {plan.window}, cache {plan.cache}, prefetch {plan.prefetch}, "
                        f"update {plan.update}")
    for col in ("block", "home", "stream", "recompute", "offload_hidden"):
        table.add_column(col)
    for b, bp in zip(profile.blocks, plan.blocks):
        table.add_row(b.name, bp.home.value, _yes(bp.stream), _yes(bp.recompute), _yes(bp.offload_hidden))
    console.print(table)
    console.print(f"predicted step {sim.step_s * 1e3:.1f} ms; bottleneck {sim.bottleneck}; peaks "
                  + ", ".join(f"{t} {format_bytes(v)}" for t, v in sim.peaks.items()))
    for c in cands:
        if c.sim is None:
            console.print(f"  {c.solver:10s} found no plan that fits")
        else:
            console.print(f"  {c.solver:10s} {c.sim.step_s * 1e3:9.1f} ms  (+{(c.sim.step_s / sim.step_s - 1) * 100:.1f}%)")


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def write_png(sim: Simulation, path: Path) -> None:
    """Resource timelines above, the memory of each tier over the step below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("writing a PNG needs matplotlib: pip install 'tiertrain[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for row, res in enumerate(RESOURCES):
        spans = [(s, e - s) for r, s, e, _ in sim.timeline.tasks if r == res]
        top.broken_barh(spans, (row - 0.4, 0.8))
    top.set_yticks(range(len(RESOURCES)), RESOURCES)
    top.set_title(f"predicted step {sim.step_s * 1e3:.1f} ms, bottleneck {sim.bottleneck}")
    for tier in ("device", "host", "disk"):
        pts = sorted((t, v) for t, k, v in sim.memory if k == tier)
        if pts:
            bottom.step([t for t, _ in pts], [v / 2**20 for _, v in pts], where="post", label=tier)
    bottom.set_ylabel("MiB in use")
    bottom.set_xlabel("seconds into the step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
