"""Gradient clipping's arithmetic, as ``torch.nn.utils.clip_grad_norm_`` does it, over gradients
wherever they are kept (the runtime hands in views of its gradient chunks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def total_norm(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global norm of ``grads`` (torch's own ``get_total_norm``, so the same bits)."""
    if not grads:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(list(grads), norm_type)


def clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient, clamped to 1 (so clipping never scales up)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
