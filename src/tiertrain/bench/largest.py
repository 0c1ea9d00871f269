"""``tiertrain bench largest``: the largest GPT this machine really trains within its budgets, found by
real runs, beside the capacity bound and beside what ``plan --max-model`` predicts.

``plan --max-model`` answers from the planner's arithmetic, with no model built; the figure the papers
lead with (STRONGHOLD: 39.5B on one V100; ANGEL-PTM: 114.8% larger than the best offload baseline) is
a model that trained. So the planner's answer seeds a search over real runs: its width kept, its depth
galloped up from there while runs train (or down while they fail), then bisected. Each trial trains
a few steps with ``--plan auto`` in a process of its own (``train_trial``); a model trains when every
step finished with a finite loss. The search stops after ``max_trials`` runs and says how far apart
the deepest that trained and the shallowest that did not still are.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tiertrain.autoplan.largest_model import (
    Largest,
    beyond_capacity,
    gpt3_shape,
    last_fitting,
)
from tiertrain.bench.train_trial import TrainArgs, Trial
from tiertrain.errors import UserError
from tiertrain.models.accounting import param_count
from tiertrain.plan import Budgets
from tiertrain.plan.fit import capacity_params, within_capacity
from tiertrain.units import format_bytes, format_count


def largest_depth(seed: int, limit: int, trains: Callable[[int], bool],
                  max_trials: int) -> tuple[int | None, int]:
    """The deepest depth in [1, limit) for which ``trains`` holds (assumed monotone: a deeper model at
    the same width needs more of every tier), and the shallowest known not to (``limit`` if none
    failed). Starts at ``seed`` and gallops (steps of seed/8, doubling) before it bisects; each depth is
    tried at most once; at most ``max_trials`` tries, after
    which the answer is the deepest that trained so far (None where none did)."""
    tried: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = trains(n)
        return tried[n]

    def more() -> bool:
        return len(tried) < max_trials

    seed = max(1, min(seed, limit - 1))
    lo, hi = (seed, limit) if ok(seed) else (None, seed)
    step = max(1, seed // 8)  # an eighth of the seed, doubling: a planner off by a third costs 3 runs, not 6
    if lo is not None:  # gallop up: seed + step, + 2 step, + 4 step ... until one fails or the bound is reached
        while lo + step < limit and more():
            if not ok(lo + step):
                hi = lo + step
                break
            lo, step = lo + step, 2 * step
    else:  # gallop down until one trains, or depth 1 did not
        while hi > 1 and more():
            n = max(1, hi - step)
            if ok(n):
                lo = n
                break
            hi, step = n, 2 * step
    if lo is None:
        return None, hi
    while hi - lo > 1 and more():
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, hi


def depth_limit(width: int, seq: int, sizes: Budgets) -> int:
    """The first depth at ``width`` past the capacity bound: no plan can hold it, so no run is tried."""
    def params(n: int) -> int:
        return param_count(gpt3_shape(n, width, seq))

    return last_fitting(1, beyond_capacity(sizes, params), lambda n: within_capacity(params(n), sizes)) + 1


@dataclass
class LargestRun:
    """The search's answer and every trial, for the printed report and ``--json``."""

    seed: Largest
    sizes: Budgets
    trials: list[Trial]
    best: Trial | None
    first_failed: int       # the shallowest depth that did not train, or ``limit`` where none failed
    limit: int = 0          # the first depth past the capacity bound (never tried)

    @property
    def bound_params(self) -> int:
        return capacity_params(self.sizes)

    def figures(self) -> dict:
        best = self.best
        return {"budgets": {"device": self.sizes.device, "host": self.sizes.host, "disk": self.sizes.disk},
                "capacity_bound_params": self.bound_params,
                "max_model": {"layers": self.seed.cfg.n_layer, "width": self.seed.cfg.d_model,
                              "params": self.seed.params, "plan": self.seed.chosen.plan.name,
                              "predicted_step_s": self.seed.chosen.sim.step_s},
                "largest": None if best is None else {"layers": best.cfg.n_layer, "width": best.cfg.d_model,
                                                      "params": best.params, "step_s": best.step_s,
                                                      "of_bound": best.params / max(self.bound_params, 1)},
                "first_failed_layers": self.first_failed if self.first_failed != self.limit else None,
                "capacity_bound_layers": self.limit,
                "trials": [{**{k: v for k, v in asdict(t).items() if k != "cfg"}, "layers": t.cfg.n_layer,
                            "width": t.cfg.d_model} for t in self.trials]}

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.figures(), indent=2) + "\n")


def search(seed: Largest, sizes: Budgets, seq: int, run: Callable[..., Trial], max_trials: int,
           say: Callable[[str], None]) -> LargestRun:
    """Real runs at the seed's width from the seed's depth (``run(cfg, params) -> Trial``), each told
    as it ends."""
    width = seed.cfg.d_model
    trials: dict[int, Trial] = {}

    def trains(n: int) -> bool:
        cfg = gpt3_shape(n, width, seq)
        params = param_count(cfg)
        say(f"trial {len(trials) + 1}: {n} blocks x width {width} ({format_count(params)} params) ...")
        trials[n] = trial = run(cfg, params)
        say("  " + describe(trial))
        if trial.fatal:
            raise UserError(f"trial {len(trials)} was refused for another reason than its size ({trial.why}); "
                            "fix that first: no trial would train")
        return trial.trained

    limit = depth_limit(width, seq, sizes)
    best, hi = largest_depth(seed.cfg.n_layer, limit, trains, max_trials)
    return LargestRun(seed, sizes, list(trials.values()), trials.get(best) if best is not None else None, hi, limit)


def describe(t: Trial) -> str:
    if not t.trained:
        return f"did not train: {t.why} [{t.seconds:.0f} s]"
    peaks = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(t.peaks.items()))
    step = f"step {t.step_s:.2f} s" if t.step_s is not None else "one step"
    return (f"trained {len(t.losses)} steps, loss {t.losses[0]:.3f} -> {t.losses[-1]:.3f}, {step}, "
            f"peaks {peaks} [{t.seconds:.0f} s]")


def report(found: LargestRun, say: Callable[[str], None]) -> None:
    seed, bound = found.seed, found.bound_params
    say(f"capacity bound (device + host + disk) / 16 B per param: {format_count(bound)} params")
    say(f"plan --max-model: {seed.cfg.n_layer} blocks x width {seed.cfg.d_model}, {format_count(seed.params)} "
        f"params ({seed.params / max(bound, 1):.0%} of the bound), plan {seed.chosen.plan.name}, predicted step "
        f"{seed.chosen.sim.step_s:.2f} s")
    best = found.best
    if best is None:
        say(f"no trial trained (the shallowest tried: {found.first_failed} blocks); see each trial's reason above")
        return
    untried = found.first_failed - best.cfg.n_layer - 1
    gap = "" if untried == 0 else (
        f"; the search stopped with {untried} depths between it and the shallowest that did not train untried "
        "(raise --max-trials)" if found.first_failed != found.limit else
        f"; the search stopped before any trial failed, {untried} depths below the capacity bound's untried "
        "(raise --max-trials)")
    say(f"largest that trained: {best.cfg.n_layer} blocks x width {best.cfg.d_model}, {format_count(best.params)} "
        f"params: {best.params / max(bound, 1):.0%} of the capacity bound (target 90%), "
        f"{best.params / max(seed.params, 1):.2f}x plan --max-model's answer{gap}")


def seed_model(sizes: Budgets, disk_dir: str | None, args: TrainArgs) -> Largest:
    """``plan --max-model``'s answer for this machine (probed) at the trials' budgets, batch shape, update
    mode and clipping, as ``train --plan auto`` runs them."""
    from tiertrain.autoplan.largest_model import RunShape, largest_model
    from tiertrain.measure.machine import probe, with_disk_gain
    from tiertrain.plan import DEFAULT_MAX_STALENESS, RunOptions

    target = with_disk_gain(probe(disk_dir), disk_dir)
    needs_all = RunOptions(grad_accum=1, max_grad_norm=args.grad_clip or None).needs_all_grads(args.precision)
    shape = RunShape(args.batch_size, args.seq_len, args.precision, args.update, needs_all, DEFAULT_MAX_STALENESS,
                     target.page_size or 4 << 20)
    return largest_model(target, sizes, shape)


def _release_device_cache() -> None:
    """What this process's probe cached on the GPU goes back before the trials, which take their budgets."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def bench_largest(args: TrainArgs, max_trials: int, say: Callable[[str], None], json_path: Path | None = None,
                  run: Callable[..., Trial] | None = None) -> LargestRun:
    """Seed with ``plan --max-model``, search by real runs, print the answer beside both bounds."""
    from tiertrain.bench.train_trial import run_trial

    sizes = Budgets.parse(args.device_memory, args.host_memory, args.disk)
    root = None
    if sizes.disk_dir:  # the seed probed, and every trial paged, in one private folder of this bench's
        Path(sizes.disk_dir).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="tiertrain-largest-", dir=sizes.disk_dir))
        args = dataclasses.replace(args, disk=f"{root}:{sizes.disk}")
    try:
        seed = seed_model(sizes, str(root) if root else None, args)
        _release_device_cache()
        say(f"budgets: device {format_bytes(sizes.device)}, host {format_bytes(sizes.host)}, disk "
            f"{format_bytes(sizes.disk)}; batch {args.batch_size} x {args.seq_len} tokens, {args.precision}, "
            f"{args.update} updates, " + (f"clipped at {args.grad_clip:g}" if args.grad_clip else "no clipping")
            + f"; {args.steps} steps a trial, at most {max_trials} trials")
        found = search(seed, sizes, args.seq_len, run or (lambda cfg, params: run_trial(cfg, params, args)),
                       max_trials, say)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    report(found, say)
    if json_path is not None:
        found.write_json(json_path)
    return found
