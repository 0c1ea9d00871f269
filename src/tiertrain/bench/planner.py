"""Planner benchmarks, each figure beside its limit or its peer, measured in the same run.

``solver``: the DP's time for 100 blocks, m=128 device levels and the full switch set,
against the 2 s limit (H3T's Python DP took minutes, its Table 5).

``fidelity``: for plans of different character on one model, the simulator's predicted step
time and device peak (from a profile measured here) against the step time and the device
pool's page peak measured by running each plan; limits 10% and 5%.

``auto``: the auto plan against every built-in plan that fits, run on the same model under
a loose and a tight device budget.

``estimate``: the profile ``plan auto`` makes of a model it cannot run (one block measured, or
the analytic estimate) against the whole model's profile measured in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from tiertrain.bench.machine import synchronize
from tiertrain.bench.runtime import model_cfg
from tiertrain.measure.machine import probe_machine
from tiertrain.measure.model import measure_profile, profile_key
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw
from tiertrain.memory import Budgets, Tier
from tiertrain.memory.system import compute_device
from tiertrain.models import ModelConfig, build, param_count
from tiertrain.plan import BlockPlan, Plan, builtin_plan
from tiertrain.plan.bytes import pages
from tiertrain.plan.update_modes import steps_per_disk_pass
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.planner.simulator import simulate
from tiertrain.planner.solvers import Problem, dynamic_programming
from tiertrain.runtime.blocks import find_blocks
from tiertrain.units import format_bytes

MiB = 1 << 20
WARMUP = 2


def synthetic_profile(n_blocks: int) -> Profile:
    """A GPT-like stack whose numbers make every switch worth something somewhere."""
    blocks = tuple(BlockProfile(f"b{i}", 0.010 * (1 + 0.1 * (i % 7)), 0.020 * (1 + 0.1 * (i % 5)), 12 * MiB // 4,
                                (64 + 8 * (i % 3)) * MiB, 4 * MiB) for i in range(n_blocks))
    machine = MachineProfile(h2d_bps=12e9, d2h_bps=12e9, disk_read_bps=2e9, disk_write_bps=1.5e9,
                             adam_params_per_s=1e9)
    return Profile(blocks, BlockProfile("rest", 0.002, 0.004, 8 * MiB, 32 * MiB, 4 * MiB), machine)


def bench_solver(n_blocks: int, levels: int, out: Callable[[str], None]) -> dict:
    p = synthetic_profile(n_blocks)
    total = sum(b.params * 16 + b.act_bytes for b in p.blocks)
    pb = Problem(p, Budgets(total // 3, total * 2, total * 4), levels=levels)
    times, found = [], None
    for _ in range(3):
        t = time.perf_counter()
        found = dynamic_programming(pb)
        times.append(time.perf_counter() - t)
    out(f"DP over {n_blocks} blocks x 16 switch choices, m={levels} device levels, {pb.host_levels} host levels, "
        f"windows {pb.windows}: {min(times):.3f} s (best of 3; max {max(times):.3f} s); limit 2 s"
        + ("" if found else "  [found no plan: the instance is too tight]"))
    return {"seconds": min(times), "found": found is not None}


def fidelity_plans(n: int, disk: bool) -> dict[str, Plan]:
    """Six characters: all resident; a streaming window; recompute and a one-slot window;
    states homed on disk; and the same on disk without waiting for the optimizer, at staleness 1
    and 4 (a disk pass every 4 steps)."""
    plans = {"resident": builtin_plan("resident", n), "stream": builtin_plan("stream", n),
             "max-offload": builtin_plan("max-offload", n, disk=False)}
    if disk:
        on_disk = BlockPlan(home=Tier.DISK, stream=True, param_copy=True)
        plans["disk-homed"] = Plan((on_disk,) * n, BlockPlan(home=Tier.HOST), window=2, prefetch=1,
                                   update="overlap", name="disk-homed")
        plans["lockfree"] = dataclasses.replace(plans["disk-homed"], update="lockfree", name="lockfree")
        plans["lockfree4"] = dataclasses.replace(plans["lockfree"], max_staleness=4, name="lockfree4")
    return plans


class _Run:
    """A model of the benchmark's config, a batch, and a way to time steps of it under a plan."""

    def __init__(self, cfg: ModelConfig, batch: int, seq: int) -> None:
        self.cfg = cfg
        self.x = torch.randint(0, cfg.vocab_size, (batch, seq + 1),
                               generator=torch.Generator().manual_seed(0)).to(compute_device())

    def fresh(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return build(self.cfg)

    def step_of(self, model: torch.nn.Module) -> Callable[[], None]:
        """One plain forward+backward of ``model`` on the batch (a profile step; says its shape)."""
        def step() -> None:
            lm_loss(model, self.x[:, :-1], self.x[:, 1:]).backward()

        step.shape = tuple(self.x.shape)
        return step

    def profile(self, disk_dir: str | None, page: int) -> Profile:
        model = self.fresh().to(self.x.device)
        machine, _ = probe_machine(disk_dir)
        return measure_profile(model, find_blocks(model), self.step_of(model), machine, "fp32",
                               profile_key(model, tuple(self.x.shape), "fp32", self.x.device), page, steps=5)

    def measure(self, plan: Plan | str, budgets: Budgets, page: int, steps: int,
                update: str | None = None) -> tuple[list[float], int, Plan]:
        """(step seconds after warm-up, device pool page peak, the plan that ran)."""
        import tiertrain

        model = self.fresh()
        opt, _ = make_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
        tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, page_size=page, update=update,
                                   profile_step=self.step_of(model))
        times = []
        try:
            for _ in range(steps + WARMUP):
                synchronize(self.x.device)
                t = time.perf_counter()
                lm_loss(tm, self.x[:, :-1], self.x[:, 1:]).backward()
                topt.step()
                topt.zero_grad()
                synchronize(self.x.device)
                times.append(time.perf_counter() - t)
            peak = tm.runtime.mem.stats()["device"]["pages_peak_bytes"]
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()
        return times[WARMUP:], peak, tm.runtime.plan


def bench_fidelity(d: int, layers: int, batch: int, seq: int, steps: int, disk_dir: str | None,
                   out: Callable[[str], None], rounds: int = 3) -> dict:
    """Each round profiles the model and then runs every plan (interleaved), and each plan's
    prediction is checked against the measurement of the same round: the profile and the runs it
    predicts see the same spell of a shared machine. The figure is the median over rounds."""
    cfg = model_cfg(d, layers, max(256, seq))
    run, page = _Run(cfg, batch, seq), MiB
    directory = Path(disk_dir or tempfile.mkdtemp(prefix="tiertrain-bench-", dir="."))
    n = param_count(cfg)
    room = max(256 * MiB, 64 * n)
    budgets = Budgets(device=room, host=room, disk=room, disk_dir=str(directory))
    plans = fidelity_plans(layers, disk=True)
    rows: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in plans}
    for r in range(rounds):
        profile = run.profile(str(directory), page)
        if r == 0:
            _describe(profile, cfg, batch, seq, page, out)
        for name, plan in plans.items():
            every = steps_per_disk_pass(plan.update, plan.max_staleness)
            times, peak, _ = run.measure(plan, budgets, page, every * -(-max(2, steps // 2) // every))
            # lockfree's passes come every few steps: the mean over whole passes is its step
            measured = statistics.fmean(times) if every > 1 else statistics.median(times)
            sim = simulate(plan, profile)
            rows[name].append((sim.step_s, measured, sim.peaks["device"], peak))
    results = {}
    for name, per_round in rows.items():
        errors = [p / m - 1 for p, m, _, _ in per_round]
        predicted, measured = (statistics.median(x[k] for x in per_round) for k in (0, 1))
        t_err = statistics.median(errors)
        peak_pred, peak = per_round[-1][2], per_round[-1][3]
        m_err = peak_pred / max(peak, 1) - 1
        results[name] = {"predicted_s": predicted, "measured_s": measured, "predicted_peak": peak_pred,
                         "measured_peak": peak, "step_error": t_err, "step_errors": errors, "peak_error": m_err}
        out(f"{name:12s} step predicted {predicted * 1e3:7.1f} ms, measured {measured * 1e3:7.1f} ms "
            f"({t_err * 100:+5.1f}% median of {rounds} rounds, min {min(errors) * 100:+.1f}%, max "
            f"{max(errors) * 100:+.1f}%; limit 10%); device peak predicted {format_bytes(peak_pred)}, "
            f"measured {format_bytes(peak)} ({m_err * 100:+5.1f}%, limit 5%)")
    if disk_dir is None:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    return results


def bench_estimate(d: int, layers: int, batch: int, seq: int, out: Callable[[str], None], rounds: int = 3) -> dict:
    """What ``plan auto`` plans a model from when it cannot run the plain model (built on meta, or
    too big for the device): one of its blocks measured, and the analytic estimate where even that
    does not fit, each against the whole model measured here, in turns over ``rounds`` rounds."""
    from tiertrain.measure.analytic import analytic_profile
    from tiertrain.measure.one_block import measure_one_block

    cfg = model_cfg(d, layers, max(256, seq))
    run = _Run(cfg, batch, seq)
    machine, flops = probe_machine(None)
    meta = build(cfg, device="meta")
    shape = (batch, seq)
    rows: dict[str, list[Profile]] = {"measured": [], "one block": [], "analytic": []}
    for _ in range(rounds):
        rows["measured"].append(run.profile(None, MiB))
        rows["one block"].append(measure_one_block(meta, find_blocks(meta), cfg, shape, "fp32", run.x.device,
                                                   machine, flops, "bench"))
        rows["analytic"].append(analytic_profile(cfg, batch, seq))
    totals = {name: statistics.median(_compute_s(p) for p in ps) for name, ps in rows.items()}
    acts = {name: ps[-1].blocks[0].act_bytes for name, ps in rows.items()}
    out(f"model {param_count(cfg) / 1e6:.1f}M params ({layers} blocks, d {d}), batch {batch} x {seq}: block and "
        f"head compute per step (forward + backward + recompute), median of {rounds} rounds")
    for name in rows:
        out(f"{name:9s} {totals[name] * 1e3:8.1f} ms ({(totals[name] / totals['measured'] - 1) * 100:+6.1f}%), "
            f"saved activations per block {format_bytes(acts[name])} "
            f"({(acts[name] / acts['measured'] - 1) * 100:+6.1f}%)")
    return {"compute_s": totals, "act_bytes": acts}


def _compute_s(p: Profile) -> float:
    return sum(b.forward_s + b.backward_s + b.recompute_seconds for b in p.blocks) + p.rest.forward_s + p.rest.backward_s


def _describe(profile: Profile, cfg, batch: int, seq: int, page: int, out: Callable[[str], None]) -> None:
    m, n = profile.machine, param_count(cfg)
    out(f"model {n / 1e6:.1f}M params ({cfg.n_layer} blocks, d {cfg.d_model}), batch {batch} x {seq}, page "
        f"{format_bytes(page)}; profile measured here ({sum(b.forward_s + b.backward_s for b in profile.blocks) * 1e3:.0f} "
        "ms of block compute)")
    out(f"machine profile: copies {m.h2d_bps / 1e9:.1f} GB/s in, {m.d2h_bps / 1e9:.1f} GB/s out; disk "
        f"{m.disk_read_bps / 1e9:.2f} GB/s read, {m.disk_write_bps / 1e9:.2f} GB/s write, "
        f"{m.disk_cpu_s_per_byte * 1e9:.2f} CPU-s per GB; AdamW {m.adam_params_per_s / 1e6:.0f} M params/s")


def bench_auto(d: int, layers: int, batch: int, seq: int, steps: int, out: Callable[[str], None],
               rounds: int = 3) -> dict:
    """Under each device budget, every built-in plan that fits and the auto plan, all with overlapped
    updates; the plans take turns over ``rounds`` rounds and each figure is the median of its rounds."""
    cfg = model_cfg(d, layers, max(256, seq))
    run, page, n = _Run(cfg, batch, seq), MiB, param_count(cfg)
    per_block = sum(p.numel() for p in run.fresh().blocks[0].parameters())
    blk, rest = pages(per_block * 4, page), pages((n - layers * per_block) * 4, page)
    # tight: room for the rest and a few blocks' params, no states; tightest: one slot, under the
    # two slots every streaming built-in needs
    budgets = {"loose": 32 * n + rest, "tight": rest + 4 * blk, "tightest": rest + blk + blk // 2}
    results = {}
    for label, device in budgets.items():
        b = Budgets(device=device, host=max(256 * MiB, 64 * n))
        out(f"device budget {label} ({format_bytes(device)}), model {n / 1e6:.1f}M params, batch {batch} x {seq}:")
        times, ran = _take_turns(run, b, page, max(2, steps // 2), rounds)
        for name in ("resident", "stream", "max-offload", "auto"):
            if name not in times:
                out(f"  {name:12s} does not fit")
                continue
            peak, plan = ran[name]
            detail = (f" ({plan.name}: {sum(x.stream for x in plan.blocks)}/{layers} streamed, window {plan.window} "
                      f"+ cache {plan.cache}, {sum(x.recompute for x in plan.blocks)} recompute)") if name == "auto" else ""
            out(f"  {name:12s} step {statistics.median(times[name]) * 1e3:7.1f} ms (min {min(times[name]) * 1e3:.1f}, "
                f"max {max(times[name]) * 1e3:.1f} over {len(times[name])} rounds), device peak {format_bytes(peak)}{detail}")
        medians = {k: statistics.median(v) for k, v in times.items()}
        builtin = {k: v for k, v in medians.items() if k != "auto"}
        if "auto" in medians and builtin:
            best = min(builtin, key=builtin.get)
            out(f"  auto against the best built-in ({best}): {builtin[best] / medians['auto']:.2f}x "
                f"(target >= 1.00 within noise; faster where memory is tight)")
        elif "auto" in medians:
            out("  auto trains where no built-in plan fits")
        results[label] = medians
    return results


def _take_turns(run: "_Run", budgets: Budgets, page: int, steps: int, rounds: int) -> tuple[dict, dict]:
    """Median step per round of each plan that fits, the plans in turn each round, in a rotated order
    (a slow spell of a shared machine, or what one plan leaves behind, then hits them all); with each
    plan's device peak and the plan that ran."""
    from tiertrain.planner.auto import NoPlanFits
    from tiertrain.plan.fit import PlanDoesNotFit

    times: dict[str, list[float]] = {}
    ran: dict[str, tuple[int, Plan]] = {}
    unfit: set[str] = set()
    names = ["resident", "stream", "max-offload", "auto"]
    for r in range(rounds):
        for name in names[r % 4:] + names[: r % 4]:  # each round starts with another plan
            if name in unfit:
                continue
            try:
                step_times, peak, plan = run.measure(name, budgets, page, steps, update="overlap")
            except (PlanDoesNotFit, NoPlanFits):
                unfit.add(name)
                continue
            times.setdefault(name, []).append(statistics.median(step_times))
            ran[name] = (peak, plan)
    return times, ran
