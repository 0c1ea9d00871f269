"""Top-k gated mixture-of-experts feed-forward (Switch Transformer / T5-MoE style).

Dropless (no capacity factor): every token reaches its k experts, which keeps the
numerics a pure function of the inputs, as the bitwise offloading tests need.
Experts sit in an ``nn.ModuleList`` so that expert-parallel work can place them later.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiertrain.models.config import ModelConfig


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.n_experts = cfg.n_experts
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        from tiertrain.models.gpt import MLP  # an expert is the dense model's MLP (gpt.py imports this file)

        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.last_aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:  # T5-MoE: renormalise the chosen gates
            gate = gate / gate.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (choice == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert(tokens.index_select(0, rows)) * gate[rows, slot].unsqueeze(1).to(tokens.dtype)
            out = out.index_add(0, rows, y)
        self.last_aux_loss = self._balance_loss(probs, choice)
        return out.reshape(shape)

    def _balance_loss(self, probs: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """Switch Transformer eq. 4: n_experts * sum_e (fraction routed to e) * (mean prob of e)."""
        routed = F.one_hot(choice[:, 0], self.n_experts).float().mean(dim=0)
        return self.n_experts * (routed * probs.mean(dim=0)).sum()
