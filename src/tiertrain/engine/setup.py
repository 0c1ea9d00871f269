"""``tiertrain.setup``: the one call that puts a model's training state in tiers.

It returns a model and an optimizer that a plain loop drives unchanged::

    model, opt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True),
                                 memory=Budgets.parse("2GiB", "16GiB", "/nvme:200GiB"), plan="stream")
    loss = model(x, y); loss.backward()
    model.clip_grad_norm_(1.0)      # as torch.nn.utils.clip_grad_norm_, over the offloaded gradients
    opt.step(); opt.zero_grad()

Gradients leave the parameters as backward produces them, so clip through the model
(``model.clip_grad_norm_``, FSDP's convention) rather than over ``model.parameters()``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, MemorySystem
from tiertrain.memory.capacity import check_budgets
from tiertrain.memory.page_size import page_size_for
from tiertrain.memory.system import compute_device
from tiertrain.runtime.blocks import find_blocks
from tiertrain.runtime.budget_check import check_fits, fits, widest_read_ahead
from tiertrain.plan import DEFAULT_MAX_STALENESS, Plan, check_update_mode, load_plan, needs_all_grads
from tiertrain.runtime.runtime import Runtime

if TYPE_CHECKING:
    from tiertrain.engine.auto_plan import AutoPlan

_HPARAMS = ("lr", "betas", "eps", "weight_decay")


def _groups_from(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[list[dict[str, Any]], dict[int, int]]:
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ConfigError(f"tiertrain runs AdamW; got {type(optimizer).__name__}. Pass torch.optim.AdamW(...)")
    if optimizer.state:
        raise ConfigError("pass a fresh AdamW (no steps taken yet); resume through tiertrain's checkpoints instead")
    groups, group_of = [], {}
    for g, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad") or group.get("maximize"):
            raise ConfigError("amsgrad and maximize are not supported by tiertrain's AdamW yet")
        groups.append({k: group[k] for k in _HPARAMS})
        for p in group["params"]:
            group_of[id(p)] = g
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ConfigError(f"the optimizer does not hold parameter(s) {missing[:3]}; build it over model.parameters()")
    return groups, group_of


class TieredModel(nn.Module):
    """The user's model, with its parameters in device slots; call it as the model itself."""

    def __init__(self, module: nn.Module, runtime: Runtime, auto: AutoPlan | None = None) -> None:
        super().__init__()
        self.module = module
        self._rt = runtime
        self.auto_plan = auto  # plan="auto": the profile, the solver chosen and its prediction

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._rt.params_ready(self._rt.states[-1])  # embeddings and head are used first and last
        self._rt.cache.new_pass()
        out = self.module(*args, **kwargs)
        scaler = self._rt.scaler
        return scaler.wrap_outputs(out) if scaler is not None and torch.is_grad_enabled() else out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients of the current accumulation window."""
        rt = self._rt
        if rt.plan.update == "lockfree":
            raise ConfigError("lockfree updates start before a global norm exists, so they cannot clip by it; "
                              "train without clipping (grad_clip: 0) or use --update overlap")
        if rt.plan.update == "overlap":
            if rt.max_grad_norm != max_norm:
                raise ConfigError(
                    f"in overlap mode updates start during backward, so clipping must be declared up front: "
                    f"tiertrain.setup(..., max_grad_norm={max_norm})")
            return rt.last_norm
        return rt.clip_grad_norm_(max_norm, norm_type)

    @property
    def runtime(self) -> Runtime:
        return self._rt


class TieredOptimizer:
    """AdamW over the tiered states; ``param_groups[i]["lr"]`` is read at each update."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self.param_groups = runtime.groups

    @property
    def loss_scaler(self):
        """fp16 plans: the dynamic loss scaler (GradScaler's rule and state dict); None otherwise."""
        return self._rt.scaler

    def step(self) -> None:
        self._rt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._rt.zero_grad()


def setup(model: nn.Module, optimizer: torch.optim.Optimizer | None, memory: Budgets, plan: "str | Plan" = "resident",
          *, grad_accum: int = 1, max_grad_norm: float | None = None, update: str | None = None,
          blocks: str | None = None, page_size: int | None = None, max_staleness: int | None = None,
          compute_dtype: str | None = None, train: bool = True,
          profile_step: Callable[[], None] | None = None,
          init_states: bool = True) -> tuple[TieredModel, TieredOptimizer | None]:
    """Place ``model``'s training state in the tiers ``memory`` allows, as ``plan`` says.

    ``grad_accum`` and ``max_grad_norm`` tell the ``overlap`` mode when a block's
    gradients are final and whether to wait for the global norm before updating.
    A plan that cannot fit the budgets is refused here, before anything is allocated.
    ``train=False`` streams the blocks for forward only (a teacher larger than the device,
    STRONGHOLD's distillation case): no optimizer states, no gradients; pass ``optimizer=None``.
    ``plan="auto"`` profiles the model with ``profile_step`` (one forward+backward at the
    training batch shape; cached per machine, model and shape) and takes the planner's best plan.
    ``init_states=False`` (resuming: a checkpoint is loaded right after) allocates the states where
    they live without writing the model's weights into them: a model built on the meta device is not
    initialised, and disk-homed states are written once, by the checkpoint, instead of twice.
    """
    if next(model.parameters()).dtype != torch.float32:
        raise ConfigError("tiertrain keeps an fp32 model; build it in fp32 (mixed precision comes from the plan)")
    device = compute_device()
    check_budgets(memory, device)  # before anything is profiled, measured or reserved
    if train:
        if optimizer is None:
            raise ConfigError("training needs an optimizer: pass torch.optim.AdamW(model.parameters(), ...)")
        groups, group_of = _groups_from(optimizer, model)
    else:
        groups, group_of = [], {}
    found = find_blocks(model, blocks)
    page = page_size_for(page_size, memory.disk_dir if memory.disk else None, device)
    auto = None
    if isinstance(plan, str) and plan == "auto" and profile_step is not None:
        # refused before profiling, not after it
        check_update_mode(update or "sync", compute_dtype or "fp32", grad_accum, max_grad_norm is not None)
        auto = _auto(model, profile_step, memory, page, compute_dtype or "fp32", update or "sync",
                     needs_all_grads=needs_all_grads(max_grad_norm is not None, grad_accum, compute_dtype or "fp32"),
                     blocks=blocks, max_staleness=DEFAULT_MAX_STALENESS if max_staleness is None else max_staleness)
        plan = auto.plan
    chosen = load_plan(plan, len(found) - 1, disk=memory.disk > 0, update=update)
    if max_staleness is not None:
        chosen = dataclasses.replace(chosen, max_staleness=max_staleness).validate(len(found) - 1)
    if compute_dtype is not None:
        chosen = dataclasses.replace(chosen, compute_dtype=compute_dtype).validate(len(found) - 1)
    check_update_mode(chosen.update, chosen.compute_dtype, grad_accum, max_grad_norm is not None)
    if chosen.uses_disk and not memory.disk:
        raise ConfigError("this plan homes states on disk; give a disk budget: Budgets(..., disk=SIZE, disk_dir=DIR)")
    transient = chosen.update == "overlap" and not needs_all_grads(max_grad_norm is not None, grad_accum,
                                                                    chosen.compute_dtype if train else "fp32")
    check_fits(found, chosen, memory, page, train, transient)
    # Bounding the gradients alive makes backward wait for the optimizer: only when the host needs it
    bound_grads = transient and not fits(found, chosen, memory, page, train, transient_grads=False)
    if train:
        chosen = widest_read_ahead(found, chosen, memory, page, transient_grads=bound_grads)
    mem = MemorySystem(memory, page_size=page, check_machine=False)
    runtime = Runtime(model, groups, group_of, mem, chosen, grad_accum, max_grad_norm, blocks, train, bound_grads,
                      init_states)
    _buffers_to(model, device)
    return TieredModel(model, runtime, auto), TieredOptimizer(runtime) if train else None


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Buffers (masks, rotary tables) are no training state: they go to the compute device whole,
    where the parameters now sit in their slots, while the model object itself stays where it was built."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                module._buffers[name] = buf.to(device)


def _auto(model: nn.Module, step: Callable[[], None], memory: Budgets, page: int, precision: str, update: str,
          needs_all_grads: bool, blocks: str | None, max_staleness: int) -> AutoPlan:
    """Profile outside the run's random stream, so an auto run trains as the same plan from a file would."""
    from tiertrain.engine.auto_plan import auto_plan

    cuda = next(model.parameters()).is_cuda
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        return auto_plan(model, step, memory, page, precision, update, needs_all_grads, blocks,
                         max_staleness=max_staleness)
