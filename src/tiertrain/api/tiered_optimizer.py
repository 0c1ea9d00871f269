"""The optimizer a tiered run's loop drives: a real ``torch.optim.Optimizer``, so every LR scheduler
and transformers' ``get_scheduler`` and ``Trainer`` drive it unchanged.

Its ``param_groups`` are the live dicts the runtime reads the hyperparameters from at each update
(a scheduler's ``lr`` takes effect at the next step, as in plain PyTorch); ``step`` runs the
runtime's step (AdamW on the tiered states, where they live). ``state_dict`` speaks torch's format
(``state[i] = {step, exp_avg, exp_avg_sq}``) for runs whose optimizer states fit in host memory;
for one whose do not it names tiertrain's checkpoints, which stream them block by block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from tiertrain.errors import UserError
from tiertrain.memory.capacity import host_available
from tiertrain.optim.hparams import MOMENTS
from tiertrain.runtime.state_io import optimizer_stream, write_moments
from tiertrain.units import format_bytes

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime


class StatesTooLarge(UserError):
    """The optimizer's states do not fit in host memory to be returned as one state dict."""


class ShardedStates(UserError):
    """The optimizer's states are sharded over ranks: no rank holds the whole state dict."""


class TieredOptimizer(torch.optim.Optimizer):
    def __init__(self, runtime: "Runtime", source: torch.optim.Optimizer, after_step: Callable[[], bool] | None = None):
        """``source``: the user's AdamW, whose groups (and their hyperparameters) this takes over, holding
        the slot-backed parameters by now (setup swapped them in as each block was built);
        ``after_step``: run after each step until it returns True (``plan="auto"`` re-plans there)."""
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in source.param_groups]
        super().__init__(groups, dict(source.defaults))
        self._rt, self._after_step = runtime, after_step
        runtime.param_groups = self.param_groups  # live: what a scheduler writes, the next update reads

    @property
    def loss_scaler(self) -> Any:
        """fp16 plans: the dynamic loss scaler (GradScaler's rule and state dict); None otherwise."""
        return self._rt.scaler

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._rt.step()
        if self._after_step is not None and self._after_step():
            self._after_step = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._rt.zero_grad()

    # -- torch's state dict ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's format: ``state`` keyed by each parameter's index across the groups, ``param_groups``
        with those indices. Refused (pointing at tiertrain's checkpoints) where the states do not fit."""
        self._check_fits()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        name_to_index = {name: index[id(p)] for g in self._rt.groups for (name, _), p in zip(g.block.params, g.params)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        stream = optimizer_stream(self._rt)
        for spec, tensor in zip(stream.specs, stream.tensors()):
            name, _, kind = spec.name.partition("::")
            state.setdefault(name_to_index[name], {})[kind] = tensor.clone()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyperparameters into the live groups, moments and step counts into the chunks where they live."""
        self._check_fits()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        saved_state = state_dict["state"]
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for saved, group in zip(saved_groups, self.param_groups):  # matched by position, as torch does
            for i, p in zip(saved["params"], group["params"]):
                by_param[id(p)] = saved_state.get(i, saved_state.get(str(i), {}))
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._rt.wait_updates()
        for g in self._rt.groups:
            names = [n for n, _ in g.block.params]
            flat = {f"{n}::{k}": by_param.get(id(p), {})[k] for n, p in zip(names, g.params)
                    for k in ("step", *MOMENTS) if k in by_param.get(id(p), {})}
            write_moments(self._rt, g, {k: v.detach().float().cpu() for k, v in flat.items()}, names)

    def _check_fits(self) -> None:
        if any(g.shard is not None for g in self._rt.groups):
            raise ShardedStates("each rank of this data-parallel run holds a shard of the optimizer states, and "
                                "torch's one-dict format would need every rank to gather them at once (a loop that "
                                "saves on rank 0 only would hang); save with tiertrain's checkpoints, which every "
                                "rank writes its own shards of (tiertrain train --save-every, or "
                                "tiertrain.checkpoint.run.save_checkpoint on every rank)")
        need = sum(8 * g.layout.numel for g in self._rt.groups)  # two fp32 moments per parameter
        room = host_available()
        if need > room // 2:
            raise StatesTooLarge(f"the optimizer's states ({format_bytes(need)}) do not fit in host memory "
                                 f"({format_bytes(room)} available) as one state dict; save and resume with "
                                 "tiertrain's checkpoints (tiertrain train --save-every, or "
                                 "tiertrain.checkpoint.run.save_checkpoint), which stream them block by block")
