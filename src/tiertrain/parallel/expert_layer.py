"""What expert parallelism needs of a model: a small protocol its mixture-of-experts layers implement,
so that the runtime, the collectives and the checkpoints never import a model's own class (our GPT's
``models.moe.MoEFeedForward`` implements it, as a user's MoE layer may).

A layer holds ``n_experts`` experts, each a module (``expert(e)``); under expert parallel it is told to
keep only the experts ``owned`` by its rank and to run every expert through an ``exchange`` (the
all-to-all of ``parallel.experts``), whatever rank holds it: routing and combining stay the layer's.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch.nn as nn


@runtime_checkable
class ExpertLayer(Protocol):
    n_experts: int   # experts the layer routes tokens to, over all ranks
    owned: range     # those this rank holds (all of them until ``keep_experts``)

    def expert(self, e: int) -> nn.Module:
        """Expert ``e`` (by its index among all ``n_experts``), which this rank must hold."""

    def keep_experts(self, owned: range, exchange: Any) -> None:
        """Hold only experts ``owned`` (under their own names) and run every expert through ``exchange``."""


def expert_layers(module: nn.Module) -> list[ExpertLayer]:
    """The mixture-of-experts layers in ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, ExpertLayer)]


def expert_params(layer: ExpertLayer, experts: range | None = None) -> list[nn.Parameter]:
    """The parameters of ``experts`` of a layer (every expert it holds, by default), in expert order."""
    return [p for e in (layer.owned if experts is None else experts) for p in layer.expert(e).parameters()]
