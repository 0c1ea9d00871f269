"""``plan="auto"`` without a profile function: the user's own first step is the profile.

Elixir plans from a warm-up step and ANGEL-PTM from a traced one; a user's loop has no separate
profile function to give, so setup starts the run under the most frugal plan (``max-offload``:
it fits wherever any plan does) and watches the first training forward: a hook on the first block
keeps the shapes and dtypes of what the model passes it (hidden state, masks, rotary tables). At
the end of that optimizer step one real copy of the block (made from a shape-only copy kept at
setup) is measured on those arguments, as ``tiertrain plan`` measures one block, within the same
bounds; the solvers choose; and ``runtime.replan`` moves the states to the chosen plan before the
next step. Numerics do not change: states move byte for byte, and measuring runs outside the run's
random stream. Where the block cannot be measured, our models plan from their FLOP estimate and
other models keep ``max-offload``, with a message saying how to do better.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from tiertrain.measure.bounds import MeasureBounds
from tiertrain.memory import Budgets
from tiertrain.plan import Plan, RunOptions
from tiertrain.plan.fit import PlanDoesNotFit, resolve
from tiertrain.runtime.blocks import Block

if TYPE_CHECKING:
    from tiertrain.autoplan.auto_plan import AutoPlan
    from tiertrain.runtime.runtime import Runtime

log = logging.getLogger("tiertrain")
FIRST_PLAN = "max-offload"


def shape_only(blocks: list[Block]) -> list[Block]:
    """The blocks with meta parameters (no memory), the first with a meta copy of its module: what
    measuring needs after setup has let the model's own parameters go."""
    first = blocks[0].module
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                            for p in first.parameters()}
    stand_ins = dict(memo)
    twin = copy.deepcopy(first, memo)  # the memo stands the meta parameters in for the real ones: nothing copied
    meta = [Block(b.name, None, [(n, torch.empty_like(p, device="meta")) for n, p in b.params]) for b in blocks[1:]]
    return [Block(blocks[0].name, twin, [(n, stand_ins.get(id(p), torch.empty_like(p, device="meta"))) for n, p in blocks[0].params]), *meta]


def _meta(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_meta(v) for v in x)
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def _resized(x: Any, seen: tuple[int, int], to: tuple[int, int], hidden: bool = False) -> Any:
    """``x`` (meta) as it would be for ``to`` tokens where it was for ``seen``: a leading dimension of
    ``seen``'s rows takes ``to``'s, a later one of ``seen``'s tokens takes ``to``'s (the hidden state's
    width never does). Only shapes matter: the measured block gets fresh values of these shapes."""
    if isinstance(x, (tuple, list)):
        return type(x)(_resized(v, seen, to) for v in x)
    if not isinstance(x, torch.Tensor):
        return x
    dims = [to[0] if i == 0 and n == seen[0] else to[1] if i > 0 and n == seen[1] and not (hidden and i > 1) else n
            for i, n in enumerate(x.shape)]
    return torch.empty(dims, dtype=x.dtype, device="meta")


@dataclass
class FirstStepAuto:
    """Set at setup; ``after_step`` (the optimizer's step) plans once the first step has run."""

    blocks: list[Block]                 # shape-only: the first with a meta copy of its module
    config: Any                         # the model's config (our ModelConfig, a transformers config, or None)
    key: str                            # the profile cache key's stem (model structure, precision, device)
    budgets: Budgets
    page: int
    options: RunOptions
    precision: str
    disk_gain: float                    # the disk tier's reads and writes at once against in turns (DiskIO)
    args: tuple | None = None           # the first block's arguments in the first training forward (meta)
    kwargs: dict = field(default_factory=dict)
    tokens: tuple[int, int] | None = None
    handle: Any = None

    def watch(self, block: nn.Module) -> None:
        self.handle = block.register_forward_pre_hook(self._capture, with_kwargs=True, prepend=True)

    def _capture(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or self.args is not None:  # an evaluation pass is no training step
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return
        self.args, self.kwargs = _meta(args), {k: _meta(v) for k, v in kwargs.items()}
        self.tokens = (int(hidden.shape[0]), int(hidden.shape[1]))
        self.handle.remove()

    def inputs_at(self, shape: tuple[int, int]) -> tuple[tuple, dict]:
        assert self.args is not None and self.tokens is not None
        args = tuple(_resized(a, self.tokens, shape, hidden=i == 0) for i, a in enumerate(self.args))
        kwargs = {k: _resized(v, self.tokens, shape, hidden=not args and k == "hidden_states")
                  for k, v in self.kwargs.items()}
        return args, kwargs

    def after_step(self, rt: "Runtime", model: nn.Module) -> "AutoPlan | None":
        """Plan from the step that ran and move to that plan (None: no training forward was seen yet)."""
        if self.tokens is None:
            return None
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            auto = self._plan()
        if auto is None or auto.plan == rt.plan:
            return auto
        from tiertrain.runtime.replan import replan

        try:
            plan = resolve(auto.plan, rt.sizes, self.budgets, self.page,
                           needs_all_grads=self.options.needs_all_grads(auto.plan.compute_dtype))
        except PlanDoesNotFit as exc:
            log.warning("the auto plan does not pass the budget check (%s); staying with %s", exc, FIRST_PLAN)
            return None
        replan(rt, plan)
        print(f"tiertrain: after the first step, {auto.describe()}", file=sys.stderr)
        return auto

    def _plan(self) -> "AutoPlan | None":
        from tiertrain.autoplan.auto_plan import solved
        from tiertrain.measure.analytic import analytic_profile
        from tiertrain.measure.machine import probe, run_scratch
        from tiertrain.measure.model import cached_profile
        from tiertrain.measure.one_block import BeyondBounds, BlockInputsUnknown, profile_one_block
        from tiertrain.memory.system import compute_device
        from tiertrain.models.config import ModelConfig
        from tiertrain.plan import DEFAULT_MAX_STALENESS

        opts, tokens = self.options, self.tokens
        assert tokens is not None
        b = self.budgets
        here = probe(b.disk_dir if b.disk else None,
                     scratch=run_scratch(b.host + (b.device if compute_device().type == "cpu" else 0)))
        ours = isinstance(self.config, ModelConfig)
        key = f"{self.key}/{tokens[0]}x{tokens[1]}/{self.precision}/first-step"

        def measure() -> Any:
            return profile_one_block(self._holder(), self.blocks, self.config if ours else None, tokens,
                                     self.precision, compute_device(), here, key,
                                     MeasureBounds.default(compute_device()), self.inputs_at)

        try:
            profile, cached = cached_profile(key, measure)
        except (torch.OutOfMemoryError, MemoryError, BlockInputsUnknown, BeyondBounds, RuntimeError) as exc:
            if not ours:
                print(f"tiertrain: plan 'auto' could not measure one block after the first step ({exc}); the run "
                      f"stays with {FIRST_PLAN}. For a faster plan pass one (tiertrain plan writes a plan file) or "
                      "setup(..., profile_step=fn)", file=sys.stderr)
                return None
            profile, cached = analytic_profile(self.config, tokens[0], tokens[1], self.precision, machine=here), False
        update = opts.update or "sync"
        staleness = DEFAULT_MAX_STALENESS if opts.max_staleness is None else opts.max_staleness
        rates = dataclasses.replace(here.rates(), disk_together_gain=self.disk_gain)
        return solved(profile, cached, rates, self.page, self.budgets, update, staleness,
                      opts.needs_all_grads(self.precision))

    def _holder(self) -> nn.Module:
        """What one_block reads the model's config off (a generic model's width and heads)."""
        holder = nn.Module()
        holder.config = self.config
        return holder


def first_step_auto(model: nn.Module, found: list[Block], budgets: Budgets, page: int, opts: RunOptions,
                    device: torch.device, disk_gain: float) -> FirstStepAuto:
    """Keep what planning after the first step needs, before setup lets the model's parameters go."""
    from tiertrain.measure.model import profile_key

    key = profile_key(model, (), "", device).rstrip("/")  # the model's part; the shape is known after a step
    return FirstStepAuto(shape_only(found), getattr(model, "config", None), key, budgets, page, opts,
                         opts.compute_dtype or "fp32", disk_gain)


def first_plan(n_blocks: int, disk: bool, update: str | None) -> Plan:
    """The plan the first step runs under: the most frugal one."""
    from tiertrain.plan import load_plan

    return load_plan(FIRST_PLAN, n_blocks, disk=disk, update=update)
