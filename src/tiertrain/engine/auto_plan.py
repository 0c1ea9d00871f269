"""``--plan auto``: profile the model on this machine, run the solvers, take the best prediction.

The profile is measured once per machine + model + batch shape (``engine.measure.model``) and
cached; the solvers and the simulator are the planner's, the same ones ``tiertrain plan``
runs, so what this logs is what ``tiertrain plan --profile`` would explain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from tiertrain.engine.measure.analytic import analytic_profile
from tiertrain.engine.measure.machine import probe_machine
from tiertrain.engine.measure.model import cached_profile, measure_profile, profile_key
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.memory.system import compute_device
from tiertrain.models.config import ModelConfig
from tiertrain.plan import DEFAULT_MAX_STALENESS, Plan
from tiertrain.planner.auto import choose, run_profile
from tiertrain.planner.profile import Profile
from tiertrain.planner.simulator import Simulation
from tiertrain.planner.solvers import Problem
from tiertrain.runtime.blocks import find_blocks
from tiertrain.units import format_bytes

log = logging.getLogger("tiertrain")


@dataclass(frozen=True)
class AutoPlan:
    plan: Plan
    prediction: Simulation
    solver: str
    profile: Profile
    profile_cached: bool

    def describe(self) -> str:
        streamed = sum(b.stream for b in self.plan.blocks)
        recomputed = sum(b.recompute for b in self.plan.blocks)
        homes = {t: sum(b.home.value == t for b in self.plan.blocks) for t in ("device", "host", "disk")}
        sim = self.prediction
        how = ("one block measured" if self.profile.key.endswith("/one-block") else
               "FLOP estimate" if self.profile.key.endswith("analytic") else "whole model measured")
        return (f"auto plan from the {self.solver} solver ({'cached ' if self.profile_cached else ''}profile: {how}): "
                f"{streamed}/{len(self.plan.blocks)} blocks stream through {self.plan.window} slot(s) + "
                f"{self.plan.cache} cache, "
                f"{recomputed} recompute, states on " + ", ".join(f"{t} {n}" for t, n in homes.items() if n)
                + f"; predicted step {sim.step_s * 1e3:.1f} ms, device peak {format_bytes(sim.peaks['device'])}, "
                f"bottleneck {sim.bottleneck}")


def auto_plan(model: nn.Module, step: Callable[[], None], budgets: Budgets, page: int, precision: str,
              update: str, needs_all_grads: bool, blocks: str | None = None, use_cache: bool = True,
              max_staleness: int = DEFAULT_MAX_STALENESS) -> AutoPlan:
    """``step`` runs one plain forward+backward at the run's batch shape. A step that says its
    shape (a ``shape`` attribute, as ``ProfileStep`` has) gets a cached profile; any other is
    measured every time, since a profile of another batch shape would mislead the solvers."""
    found = find_blocks(model, blocks)
    machine, _ = probe_machine(budgets.disk_dir if budgets.disk else None)
    device = compute_device()
    shape = getattr(step, "shape", None)
    key = profile_key(model, shape or (), precision, device)

    def measure() -> Profile:
        with _on(model, device):
            return measure_profile(model, found, step, machine, precision, key, page)

    disk = budgets.disk_dir if budgets.disk else None

    def estimate(why: str) -> Profile:
        return _estimate(model, found, shape, precision, disk, key + "/one-block", why)

    if next(model.parameters()).is_meta:  # built without memory (larger than the host): one block is measured
        profile, cached = cached_profile(key + "/one-block", lambda: estimate("it was built on the meta device"),
                                         use_cache and bool(shape))
    else:
        try:
            profile, cached = cached_profile(key, measure, use_cache and bool(shape))
        except (torch.OutOfMemoryError, MemoryError):  # an estimate is not cached: a later run may fit and measure
            profile, cached = estimate("the plain model does not fit the device"), False
    profile = run_profile(dataclasses.replace(profile, machine=machine, page=page), update, max_staleness,
                          needs_all_grads)
    chosen, _ = choose(Problem(profile, budgets.device, budgets.host, budgets.disk), update=update,
                       needs_all_grads=needs_all_grads, max_staleness=max_staleness)
    return AutoPlan(chosen.plan, chosen.sim, chosen.solver, profile, cached)


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
                   use_cache: bool = True) -> Profile:
    """``tiertrain plan --model``: the profile ``plan auto`` makes of the model (ours or a transformers
    config) built on the meta device, one block measured here and cached, so both plan a model too
    big to run alike."""
    from tiertrain.models import build

    model = build(cfg, device="meta")
    key = profile_key(model, (batch, seq), precision, compute_device()) + "/one-block"
    return cached_profile(key, lambda: _estimate(model, find_blocks(model), (batch, seq), precision, disk_dir, key),
                          use_cache)[0]


def _estimate(model: nn.Module, found: list, shape: tuple | None, precision: str, disk: str | None, key: str,
              why: str | None = None) -> Profile:
    """The plain model cannot be measured (``why``: it did not fit on the device, the case tiertrain
    exists for, or it has no weights yet): measure one of its blocks and scale; where even one
    block cannot run, fall back to the analytic estimate (our models) or say what to do (others)."""
    from tiertrain.engine.measure.one_block import BlockInputsUnknown, measure_one_block

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
    machine, flops = probe_machine(disk)
    if why:
        log.warning("cannot profile the plain model (%s); measuring one of its blocks at batch %s and scaling",
                    why, "x".join(map(str, shape)))
    try:
        return measure_one_block(model, found, cfg if ours else None, shape[:2], precision, compute_device(), machine,
                                 flops, key)
    except (torch.OutOfMemoryError, MemoryError, BlockInputsUnknown) as exc:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        failed = "does not fit the device" if not isinstance(exc, BlockInputsUnknown) else f"cannot run: {exc}"
        if not ours:
            raise ConfigError(f"plan 'auto' cannot profile this model ({why}) and one of its blocks {failed}; give a "
                              "plan instead: --plan max-offload, or a plan file written by `tiertrain plan`") from None
        log.warning("one block of %s %s; planning from its analytic profile", cfg.name or "the model", failed)
        return analytic_profile(cfg, shape[0], shape[1], precision, disk)


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
