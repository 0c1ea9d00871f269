"""What a batch of tokens teaches: next-token prediction, or masked LM for encoders.

Masking draws from a generator seeded by (seed, batch number), like the sampler, so a
resumed run masks exactly what the uninterrupted run masked.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tiertrain.models.gpt import GPT, IGNORE_INDEX

MASK_FRACTION = 0.15


def causal_lm_pair(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[:, :-1], tokens[:, 1:]


def masked_lm_pair(tokens: torch.Tensor, vocab_size: int, seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style: 15% of positions replaced by the last vocabulary id and predicted."""
    x = tokens[:, :-1].clone()
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, k]).generate_state(1)[0]))
    mask = torch.rand(x.shape, generator=gen) < MASK_FRACTION
    y = torch.where(mask, x, torch.full_like(x, IGNORE_INDEX))
    x[mask] = vocab_size - 1
    return x, y


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a tiertrain wrapper (which is called in its place)."""
    return getattr(model, "module", model)


def is_encoder(model: nn.Module) -> bool:
    inner = unwrap(model)
    return isinstance(inner, GPT) and not inner.config.causal


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for our GPT (which computes it itself) or any transformers causal LM."""
    if isinstance(unwrap(model), GPT):
        return model(x, y)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=IGNORE_INDEX)
