"""AdamW's hyperparameters for one parameter group, typed.

The optimizer's ``param_groups`` stay mutable dicts (LR schedulers write ``lr`` into them every
step); an update takes a snapshot of them as this, at the moment its gradients are final, so a
worker applying it later applies the step's own values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiertrain.typed import at_least, between

KEYS = ("lr", "betas", "eps", "weight_decay")
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter states besides the step count


@dataclass(frozen=True)
class AdamWHyper:
    """The numbers that define AdamW's update (the ranges are checked where they are read from a file:
    ``typed.load``; what else a torch group holds, fused or amsgrad, is how a run was built)."""

    lr: float = field(metadata=at_least(0))
    betas: tuple[float, float] = field(metadata=between(0, 1, high_open=True))
    eps: float = field(metadata=at_least(0))
    weight_decay: float = field(metadata=at_least(0))

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> "AdamWHyper":
        """A snapshot of a torch ``param_group``'s AdamW values."""
        b1, b2 = group["betas"]
        return cls(lr=group["lr"], betas=(b1, b2), eps=group["eps"], weight_decay=group["weight_decay"])
