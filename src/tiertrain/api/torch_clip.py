"""``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` on a tiered model: the call nearly every
training loop makes (transformers' ``Trainer`` through accelerate too).

A tiered model's gradients leave its parameters for host chunks as backward makes them, so torch's
own function would find every ``.grad`` None and return a silent 0 without clipping. No hook of
torch's reaches into that function, so tiertrain puts a forwarding function in its place (in
``torch.nn.utils`` and ``torch.nn.utils.clip_grad``, once ``tiertrain.setup`` has run): given the
parameters of a tiered model it returns plain PyTorch's norm and clips as it does, through the
runtime; given any other parameters it is torch's own function, unchanged. A loop that bound the
function before tiertrain was set up (``from torch.nn.utils import clip_grad_norm_`` at import)
keeps torch's own and should call ``model.clip_grad_norm_(c)`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad

from tiertrain.errors import ConfigError

_TORCH_CLIP = clip_grad.clip_grad_norm_


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    runtimes = {id(rt): rt for rt in (getattr(p, "_tiertrain_runtime", None) for p in params) if rt is not None}
    if not runtimes:
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    rt = next(iter(runtimes.values()))
    ours = {id(p) for g in rt.groups for p in g.params}
    if len(runtimes) > 1 or {id(p) for p in params if p.requires_grad} != ours:
        raise ConfigError("clip_grad_norm_ on a tiered model clips over all of its parameters at once: pass "
                          "model.parameters() (not a subset, and not mixed with another model's)")
    norm = rt.clip_grad_norm_(float(max_norm), float(norm_type))
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    return norm


def install_clip_redirect() -> None:
    """Put ``clip_grad_norm_`` in torch's place (idempotent)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
    clip_grad.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]


def tag(params: Iterable[torch.nn.Parameter], runtime: Any) -> None:
    """Mark parameters as a tiered model's, so the redirect knows which runtime clips them."""
    for p in params:
        p._tiertrain_runtime = runtime
