"""Top-k gated mixture-of-experts feed-forward (Switch Transformer / T5-MoE style).

Dropless (no capacity factor): every token reaches its k experts, which keeps the
numerics a pure function of the inputs, as the bitwise offloading tests need.

A layer runs in three steps: route (the router's top-k), run the experts on the rows routed to
each, combine (gate-weighted, added in expert order). Only the middle step changes under expert
parallelism: ``keep_experts`` leaves the layer holding some experts and an ``ExpertExchange``
(``tiertrain.parallel.experts``) that sends each expert's rows to the rank holding it and brings
the outputs back, so routing, combining and the load-balancing loss stay this file's, per rank.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiertrain.models.config import ModelConfig


class ExpertExchange(Protocol):
    def __call__(self, moe: "MoEFeedForward", tokens: torch.Tensor,
                 rows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each expert's output for ``tokens[rows[e]]`` (None where ``rows[e]`` is empty), wherever it runs."""


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.n_experts = cfg.n_experts
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        from tiertrain.models.gpt import MLP  # an expert is the dense model's MLP (gpt.py imports this file)

        self.experts: nn.ModuleList | nn.ModuleDict = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.owned = range(cfg.n_experts)        # the experts this module holds (all, until keep_experts)
        self.exchange: ExpertExchange | None = None
        self.last_aux_loss = torch.zeros(())

    def expert(self, e: int) -> nn.Module:
        """Expert ``e`` (by its index among all ``n_experts``), which this module must hold."""
        return self.experts[e] if isinstance(self.experts, nn.ModuleList) else self.experts[str(e)]

    def keep_experts(self, owned: range, exchange: ExpertExchange) -> None:
        """Hold only experts ``owned`` (under their own names: ``experts.5`` stays ``experts.5``) and run
        every expert through ``exchange``; the others' parameters are let go of."""
        self.experts = nn.ModuleDict({str(e): self.expert(e) for e in owned})
        self.owned, self.exchange = owned, exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:  # T5-MoE: renormalise the chosen gates
            gate = gate / gate.sum(dim=-1, keepdim=True)
        routed = [(choice == e).nonzero(as_tuple=True) for e in range(self.n_experts)]
        outputs = self.run_experts(tokens, [rows for rows, _ in routed])
        out = torch.zeros_like(tokens)
        for (rows, slot), y in zip(routed, outputs):
            if y is not None:
                out = out.index_add(0, rows, y * gate[rows, slot].unsqueeze(1).to(tokens.dtype))
        self.last_aux_loss = self._balance_loss(probs, choice)
        return out.reshape(shape)

    def run_experts(self, tokens: torch.Tensor, rows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Expert ``e``'s output on ``tokens[rows[e]]`` for every ``e`` (None where no row goes to it)."""
        if self.exchange is not None:
            return self.exchange(self, tokens, rows)
        return [self.expert(e)(tokens.index_select(0, r)) if r.numel() else None for e, r in enumerate(rows)]

    def _balance_loss(self, probs: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """Switch Transformer eq. 4: n_experts * sum_e (fraction routed to e) * (mean prob of e), over
        this module's tokens (with expert parallel: this rank's)."""
        routed = F.one_hot(choice[:, 0], self.n_experts).float().mean(dim=0)
        return self.n_experts * (routed * probs.mean(dim=0)).sum()
