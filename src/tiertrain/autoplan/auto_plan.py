"""``--plan auto``: profile the model on this machine, run the solvers, take the best prediction; and,
once the run has taken a few steps, hold the prediction against them.

The profile is measured once per machine + model + batch shape (``engine.measure.model``) and
cached; the solvers and the simulator are the planner's, the same ones ``tiertrain plan`` runs, so
what this logs is what ``tiertrain plan --profile`` would explain. Profiling never needs what the
run needs: the plain model is run only within ``MeasureBounds``, else one block (``one_block``),
else the FLOP estimate; the description says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from tiertrain import typed
from tiertrain.measure import cache
from tiertrain.measure.analytic import analytic_profile
from tiertrain.measure.bounds import MeasureBounds, RunCost
from tiertrain.measure.machine import forget as forget_probe
from tiertrain.measure.machine import probe, run_scratch
from tiertrain.measure.model import cached_profile, measure_profile, profile_key
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.memory.system import compute_device
from tiertrain.models.config import ModelConfig
from tiertrain.parallel.agree import from_rank0
from tiertrain.plan import DEFAULT_MAX_STALENESS, Plan
from tiertrain.planner.auto import choose, run_profile
from tiertrain.planner.machine import Load, Machine
from tiertrain.planner.retarget import slowed
from tiertrain.planner.profile import MachineProfile, Profile
from tiertrain.planner.simulator import Simulation, simulate
from tiertrain.planner.solvers import Problem
from tiertrain.runtime.blocks import find_blocks
from tiertrain.units import format_bytes

log = logging.getLogger("tiertrain")
RECHECK_SCRATCH = 64 << 20  # what a running plan's probe may allocate at once: within the stated overhead
MISPREDICT = 0.25   # a prediction further than this from the measured step sends its measurements back
MAX_SLOWDOWN = 4.0  # the most a recheck stretches the blocks' compute for other processes' load
CHECK_AFTER = 3     # measured steps (after warm-up) the prediction is checked against


@dataclass(frozen=True)
class AutoPlan:
    plan: Plan
    prediction: Simulation
    solver: str
    profile: Profile
    profile_cached: bool
    disk_dir: str | None = None      # where the machine probe measured the disk (its cache key)
    needs_all_grads: bool = False    # as the prediction was simulated
    corrected: bool = False          # re-predicted after the first steps proved the prediction wrong

    def describe(self) -> str:
        streamed = sum(b.stream for b in self.plan.blocks)
        recomputed = sum(b.recompute for b in self.plan.blocks)
        homes = {t: sum(b.home.value == t for b in self.plan.blocks) for t in ("device", "host", "disk")}
        sim = self.prediction
        return (f"auto plan from the {self.solver} solver ({'cached ' if self.profile_cached else ''}profile: "
                f"{profile_source(self.profile)}): "
                f"{streamed}/{len(self.plan.blocks)} blocks stream through {self.plan.window} slot(s) + "
                f"{self.plan.cache} cache, "
                f"{recomputed} recompute, states on " + ", ".join(f"{t} {n}" for t, n in homes.items() if n)
                + f"; predicted step {sim.step_s * 1e3:.1f} ms, device peak {format_bytes(sim.peaks['device'])}, "
                f"bottleneck {sim.bottleneck}")

    def predicted_row(self) -> dict[str, Any]:
        """The prediction as ``metrics.jsonl`` carries it beside the measured step and tier peaks."""
        sim = self.prediction
        return {"step_s": sim.step_s, "device_peak": sim.peaks["device"], "peaks": dict(sim.peaks),
                "bottleneck": sim.bottleneck, "corrected": self.corrected}


def profile_source(p: Profile) -> str:
    """How a profile's block figures were found, in words (older cached profiles say it by their key)."""
    if p.source:
        return p.source
    return ("one block measured" if p.key.endswith("/one-block") else
            "FLOP estimate" if p.key.endswith("analytic") else "whole model measured")


def auto_plan(model: nn.Module, step: Callable[[], None], budgets: Budgets, page: int, precision: str,
              update: str, needs_all_grads: bool, blocks: str | None = None, use_cache: bool = True,
              max_staleness: int = DEFAULT_MAX_STALENESS, bounds: MeasureBounds | None = None,
              disk_gain: float = 1.0) -> AutoPlan:
    """``step`` runs one plain forward+backward at the run's batch shape. A step that says its
    shape (a ``shape`` attribute, as ``ProfileStep`` has) gets a cached profile; any other is
    measured every time, since a profile of another batch shape would mislead the solvers. Over
    several ranks rank 0 measures and every rank solves from its profile (``parallel.agree``): the
    solvers are deterministic, so all choose one plan. ``disk_gain``: how much faster the run's disk
    tier moves reads and writes at once than in turns (``engine.measure.disk_depth.DiskIO``; 1: they
    take turns, and are simulated so)."""
    profile, cached = from_rank0(
        "the model's profile", lambda: _measured(model, step, budgets, page, precision, blocks, use_cache, bounds),
        _profile_text, _profile_from)
    rates = dataclasses.replace(profile.machine, disk_together_gain=disk_gain)
    return solved(profile, cached, rates, page, budgets, update, max_staleness, needs_all_grads)


def _profile_text(measured: tuple[Profile, bool]) -> str:
    return json.dumps({"profile": dataclasses.asdict(measured[0]), "cached": measured[1]})


def _profile_from(text: str) -> tuple[Profile, bool]:
    entry = json.loads(text)
    return typed.load(Profile, entry["profile"], "rank 0's profile"), bool(entry["cached"])


def _measured(model: nn.Module, step: Callable[[], None], budgets: Budgets, page: int, precision: str,
              blocks: str | None, use_cache: bool, bounds: MeasureBounds | None) -> tuple[Profile, bool]:
    """The model's profile at this machine's rates (measured, estimated or cached), and whether it was cached."""
    found = find_blocks(model, blocks)
    disk = budgets.disk_dir if budgets.disk else None
    device = compute_device()
    here = probe(disk, scratch=run_scratch(budgets.host + (budgets.device if device.type == "cpu" else 0)))
    bounds = bounds or MeasureBounds.default(device)
    shape = getattr(step, "shape", None)
    key = profile_key(model, shape or (), precision, device)

    def measure() -> Profile:
        with _on(model, device):
            return dataclasses.replace(measure_profile(model, found, step, here.rates(), precision, key, page),
                                       source="whole model measured")

    def estimate(why: str) -> Profile:
        return _estimate(model, found, shape, precision, here, key + "/one-block", bounds, why)

    too_big = _beyond(model, found, shape, precision, here, bounds, device)
    if next(model.parameters()).is_meta:  # built without memory (larger than the host): one block is measured
        profile, cached = cached_profile(key + "/one-block", lambda: estimate("it was built on the meta device"),
                                         use_cache and bool(shape))
    elif too_big:
        profile, cached = cached_profile(key + "/one-block", lambda: estimate(too_big), use_cache)
    else:
        try:
            profile, cached = cached_profile(key, measure, use_cache and bool(shape))
        except (torch.OutOfMemoryError, MemoryError):  # an estimate is not cached: a later run may fit and measure
            profile, cached = estimate("the plain model does not fit the device"), False
    return dataclasses.replace(profile, machine=here.rates()), cached


def solved(profile: Profile, cached: bool, rates: MachineProfile, page: int, budgets: Budgets, update: str,
           max_staleness: int, needs_all_grads: bool) -> AutoPlan:
    """The solvers' best plan for a profile, simulated at ``rates`` for the run's settings."""
    profile = run_profile(dataclasses.replace(profile, machine=rates, page=page), update, max_staleness,
                          needs_all_grads)
    chosen, _ = choose(Problem.sized(profile, budgets), update=update,
                       needs_all_grads=needs_all_grads, max_staleness=max_staleness)
    disk = budgets.disk_dir if budgets.disk else None
    return AutoPlan(chosen.plan, chosen.sim, chosen.solver, profile, cached, disk, needs_all_grads)


def _beyond(model: nn.Module, found: list, shape: tuple | None, precision: str, here: Machine,
            bounds: MeasureBounds, device: torch.device) -> str:
    """Why profiling the plain model would go beyond ``bounds`` (estimated before running it), or ''."""
    if not shape or next(model.parameters()).is_meta:
        return ""
    from tiertrain.measure.one_block import model_cost

    cost: RunCost = model_cost(model, found, shape[:2], precision, here, weights_held=device.type == "cpu")
    if cost.within(bounds):
        return ""
    return (f"its profile would hold {format_bytes(cost.memory)} and take {cost.seconds:.1f} s, beyond "
            f"{bounds.describe()}")


@contextlib.contextmanager
def _on(model: nn.Module, device: torch.device) -> Iterator[None]:
    """The model on the compute device while it is profiled, where the run will compute; back where
    it was afterwards (a tiered run keeps it on the host until setup places it), also when it
    does not fit there (which sends auto to the analytic estimate)."""
    home = next(model.parameters()).device
    try:
        model.to(device)
        yield
    finally:
        model.to(home)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def config_profile(cfg: Any, batch: int, seq: int, precision: str, disk_dir: str | None,
                   use_cache: bool = True, bounds: MeasureBounds | None = None,
                   here: Machine | None = None) -> Profile:
    """``tiertrain plan --model``: the profile ``plan auto`` makes of the model (ours or a transformers
    config) built on the meta device, one block measured here within ``bounds`` and cached, so both
    plan a model too big to run alike."""
    from tiertrain.models import build

    model = build(cfg, device="meta")
    device = compute_device()
    here = here or probe(disk_dir)
    key = profile_key(model, (batch, seq), precision, device) + "/one-block"
    bounds = bounds or MeasureBounds.default(device)
    return cached_profile(key, lambda: _estimate(model, find_blocks(model), (batch, seq), precision, here, key,
                                                 bounds), use_cache)[0]


def _estimate(model: nn.Module, found: list, shape: tuple | None, precision: str, here: Machine, key: str,
              bounds: MeasureBounds, why: str | None = None) -> Profile:
    """The plain model cannot be measured (``why``: it would not fit the device or the bounds, the case
    tiertrain exists for, or it has no weights yet): measure one of its blocks, at a reduced shape if
    need be, and scale; where not even that fits, the FLOP estimate (our models) or say what to do."""
    from tiertrain.measure.one_block import BeyondBounds, BlockInputsUnknown, profile_one_block

    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cfg = getattr(model, "config", None)
    ours = isinstance(cfg, ModelConfig)
    if not shape:
        raise ConfigError(
            f"plan 'auto' measures one plain forward+backward on the device, and this model cannot run there "
            f"({why or 'it has no weights'}); give a plan instead: --plan max-offload, or a plan file written by "
            "`tiertrain plan --model ... --profile FILE`") from None
    if why:
        log.warning("cannot profile the plain model (%s); measuring one of its blocks and scaling", why)
    try:
        return profile_one_block(model, found, cfg if ours else None, shape[:2], precision, compute_device(), here,
                                 key, bounds)
    except (torch.OutOfMemoryError, MemoryError, BlockInputsUnknown, BeyondBounds) as exc:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        failed = ("does not fit the device" if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else
                  f"cannot run: {exc}" if isinstance(exc, BlockInputsUnknown) else f"cannot be measured: {exc}")
        if not ours:
            raise ConfigError(f"plan 'auto' cannot profile this model ({why}) and one of its blocks {failed}; give a "
                              "plan instead: --plan max-offload, or a plan file written by `tiertrain plan`") from None
        log.warning("one block of %s %s; planning from its analytic profile", cfg.name or "the model", failed)
        profile = analytic_profile(cfg, shape[0], shape[1], precision, machine=here)
        return dataclasses.replace(profile, source=f"{profile.source}: one block {failed}")


def recheck(auto: AutoPlan, measured_s: list[float], measured_peaks: dict[str, int], plan: Plan,
            settle: Callable[[], None] = lambda: None, load: Load | None = None) -> tuple[AutoPlan, str]:
    """The prediction against the steps that ran; where it is off by more than ``MISPREDICT``, the
    cached machine probe and profile are dropped (the next run measures both again), the machine is
    probed again now and the running ``plan`` simulated on it: the corrected prediction is returned.
    ``settle`` first waits for the run's own updates and write-backs: a probe beside them measured the
    disk at a fraction of its rate (0.26 GB/s written against 1.7, on the 354M disk plan). The probe
    allocates at most ``RECHECK_SCRATCH`` (a whole one raised a 57M run's RSS from 650 MiB to 1.27 GiB
    beside its 288 MiB of budgets: under a cap sized to them it could be killed) and is not kept: the
    next run probes in full. Its AdamW may then read up to a quarter fast where 64 MiB sit half in a
    large cache: the corrected prediction says what the run will do; the running plan stays.
    ``load``: what other processes took while the steps ran. Where the compute device is the host's cores
    and others took a quarter of them or more, the blocks compute as much longer as the cores left to us
    are fewer (at most 4x): the profile was measured on a quieter machine, and a probe taken now reads the
    links and the optimizer slow but measures no block (a disk plan predicted 299 ms and ran 605 ms beside
    another process; its re-probe alone still missed by half)."""
    med = statistics.median(measured_s)
    sim = auto.prediction
    off = sim.step_s / med - 1
    peaks = ", ".join(f"{t} {format_bytes(sim.peaks[t])} / {format_bytes(measured_peaks[t])}"
                      for t in ("device", "host", "disk") if t in measured_peaks)
    line = (f"auto plan after {len(measured_s)} steps: predicted step {sim.step_s * 1e3:.1f} ms, measured "
            f"{med * 1e3:.1f} ms ({off * 100:+.0f}%); tier peaks predicted / measured: {peaks}")
    if abs(off) <= MISPREDICT:
        return auto, line
    cache.forget("profiles", auto.profile.key)
    forget_probe(auto.disk_dir)
    settle()
    fresh = probe(auto.disk_dir, use_cache=False, scratch=RECHECK_SCRATCH)
    rates = dataclasses.replace(fresh.rates(), disk_together_gain=auto.profile.machine.disk_together_gain)
    profile = dataclasses.replace(auto.profile, machine=rates)
    shared = ""
    if load is not None and load.busy and rates.device_is_host:
        k = load.cores / max(load.cores - load.others_cores, load.cores / MAX_SLOWDOWN)
        profile = slowed(profile, k)
        shared = (f"; other processes took {load.others_cores:.1f} of {load.cores} cores while the steps ran, so "
                  f"the blocks' compute is taken as {k:.2f}x as long")
    again = simulate(plan, profile, auto.needs_all_grads)
    fixed = dataclasses.replace(auto, prediction=again, profile=profile, corrected=True)
    return fixed, (f"{line}; more than {MISPREDICT:.0%} off, so this machine was probed again "
                   f"({_changes(auto.profile.machine, fresh.rates())}) and its cached profile dropped (the next run "
                   f"measures it){shared}: corrected prediction {again.step_s * 1e3:.1f} ms "
                   f"({(again.step_s / med - 1) * 100:+.0f}%)")


def _changes(old: MachineProfile, new: MachineProfile) -> str:
    names = {"h2d_bps": "copies in", "d2h_bps": "copies out", "disk_read_bps": "disk read",
             "disk_write_bps": "disk write", "adam_params_per_s": "AdamW"}
    moved = [f"{label} {getattr(old, f) / 1e9:.2f} -> {getattr(new, f) / 1e9:.2f} G/s" for f, label in names.items()
             if abs(getattr(new, f) / getattr(old, f) - 1) > MISPREDICT]
    return ", ".join(moved) or "no rate moved by more than 25%"


class ProfileStep:
    """One plain forward+backward on random tokens of the run's shape (no optimizer step)."""

    def __init__(self, model: nn.Module, loss: Callable, vocab: int, batch: int, seq: int,
                 autocast: Callable, device: torch.device) -> None:
        self.model, self.loss, self.autocast = model, loss, autocast
        self.tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
        self.shape = (batch, seq)

    def __call__(self) -> None:
        with self.autocast():
            loss = self.loss(self.model, self.tokens[:, :-1], self.tokens[:, 1:])
        loss.backward()
