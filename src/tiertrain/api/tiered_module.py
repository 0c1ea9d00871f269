"""The user's own model object, tiered in place (as PyTorch FSDP2's ``fully_shard`` does it): its class
becomes a subclass of its class and ``TieredModule``, and hooks on it drive the runtime.

So every attribute and method the model had still works (``generate``, ``config``,
``save_pretrained``, ``train()``/``eval()``, ``named_parameters()``), and the few whose meaning
changes when parameters live in tiers are redefined here: ``state_dict`` gathers the current
weights block by block from wherever they live (disk too), ``load_state_dict`` writes them there,
``zero_grad`` also clears the gradients the runtime keeps, and moving the model (``.to``,
``.cuda``, ``.half``) is refused, since the plan decides where each parameter lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from tiertrain.errors import ConfigError
from tiertrain.runtime.state_io import current_weights, write_weights

if TYPE_CHECKING:
    from tiertrain.autoplan.auto_plan import AutoPlan
    from tiertrain.runtime.runtime import Runtime


class TieredModule(nn.Module):
    """Mixed into a tiered model's class. ``tiered_in_place`` sets ``runtime`` (the ``Runtime``) and
    ``auto_plan`` (``plan="auto"``'s choice, or None); no class annotations name them, since
    transformers resolves a model class's annotations when it is subclassed."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients of the current accumulation window
        (FSDP's spelling; ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` works too)."""
        return self.runtime.clip_grad_norm_(max_norm, norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' ``.grad`` and the gradients the runtime gathered for the step."""
        super().zero_grad(set_to_none)
        self.runtime.zero_grad()

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's state dict with every parameter's current value (fp32, on the CPU), read block by
        block from its master wherever that lives: a streamed block's slot may hold another block."""
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        keys = _keys_by_param(self, prefix)
        for g, tensors in current_weights(self.runtime):
            for p, t in zip(g.params, tensors):
                for key in keys.get(id(p), ()):
                    if key in out:
                        out[key] = t
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Parameters are written where they live (master and compute copy; moments kept), buffers as
        ``nn.Module`` loads them, once every update in flight or left for a block's next use has landed (it
        would write the last step's update over them). Missing and unexpected keys as torch reports them."""
        self.runtime.wait_updates()
        keys = _keys_by_param(self, "")
        param_keys = {k for names in keys.values() for k in names}
        others = OrderedDict((k, v) for k, v in state_dict.items() if k not in param_keys)
        loaded = super().load_state_dict(others, strict=False, assign=assign)
        missing = [k for k in loaded.missing_keys if k not in param_keys]
        for g in self.runtime.groups:
            values = []
            for p in g.params:
                given = [state_dict[k] for k in keys.get(id(p), ()) if k in state_dict]
                values.append(given[0].detach() if given else None)
                if not given:
                    missing += keys.get(id(p), [])
            if any(v is not None for v in values):
                write_weights(self.runtime, g, values)
        result = _IncompatibleKeys(missing, list(loaded.unexpected_keys))
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys "
                               f"{result.missing_keys}, unexpected keys {result.unexpected_keys}")
        return result

    def _apply(self, fn: Any, recurse: bool = True) -> "TieredModule":
        """``.to()``, ``.cuda()``, ``.half()`` and the like: a no-op where they change nothing (a loop that
        moves the model to the device it is on); refused where they would, since the plan places the
        parameters and their slots and chunks cannot move with them."""
        probe = next(p for g in self.runtime.groups for p in g.params)
        moved = fn(probe)
        if moved.device != probe.device or moved.dtype != probe.dtype:
            raise ConfigError(f"a tiered model's parameters live where its plan puts them ({probe.device}, "
                              f"{probe.dtype}); it cannot be moved to {moved.device}, {moved.dtype}. Set the precision "
                              "with the plan's compute_dtype, and build the model on the CPU before tiertrain.setup")
        return self


def _keys_by_param(model: nn.Module, prefix: str) -> dict[int, list[str]]:
    """Every state-dict key of each parameter (tied weights have several)."""
    keys: dict[int, list[str]] = {}
    for name, p in model.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        keys.setdefault(id(p), []).append(name)
    return keys


def tiered_in_place(model: nn.Module, runtime: "Runtime", auto: "AutoPlan | None") -> nn.Module:
    """Turn ``model`` into a tiered model in place: its class gains ``TieredModule`` (keeping its name,
    so what transformers writes of it, ``architectures`` in config.json, is unchanged) and its root
    hooks make its embeddings and head ready, record the pass for the device cache, and scale fp16
    gradients where the loop cannot miss them."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (TieredModule, cls), {"__module__": cls.__module__,
                                                               "__qualname__": cls.__qualname__})
    model.runtime, model.auto_plan = runtime, auto
    model.register_forward_pre_hook(lambda m, args: runtime.begin_forward())
    model.register_forward_hook(lambda m, args, out: _forward_ends(runtime, out))
    return model


def _forward_ends(rt: "Runtime", out: Any) -> Any:
    return rt.scaler.wrap_outputs(out) if rt.scaler is not None and torch.is_grad_enabled() else out
