"""AdamW as plain PyTorch builds it, with the fused kernel on CPU and CUDA.

Parameter groups follow nanoGPT: matrices and embeddings decay, biases and norms do
not. The index -> name map lets checkpoints key optimizer state by parameter name.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def make_adamw(model: nn.Module, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float) -> tuple[torch.optim.AdamW, dict[int, str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    names = {i: n for i, (n, _) in enumerate(decay + no_decay)}
    groups = [{"params": [p for _, p in decay], "weight_decay": weight_decay},
              {"params": [p for _, p in no_decay], "weight_decay": 0.0}]
    device = named[0][1].device.type if named else "cpu"
    fused = device in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused), names
