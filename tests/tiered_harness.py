"""Run the same model, data and seed plainly and through tiertrain.setup; return the losses."""

from __future__ import annotations

import torch

import tiertrain
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw
from tiertrain.memory import Budgets
from tiertrain.models import build

HF_GPT2 = {"model_type": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
TINY4 = {"n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256, "max_seq_len": 64}


def batches(n: int, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 17), generator=g).to(device) for _ in range(n)]


def _fresh(model_spec):
    torch.manual_seed(0)
    model = build(model_spec)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    return model, opt


def _loop(model, opt, clip_fn, steps: int, accum: int, clip: float | None, device: str = "cpu") -> list[float]:
    data, losses = batches(steps * accum, device=device), []
    for s in range(steps):
        total = 0.0
        for a in range(accum):
            b = data[s * accum + a]
            loss = lm_loss(model, b[:, :-1], b[:, 1:]) / accum
            loss.backward()
            total += loss.item()
        if clip:
            clip_fn(clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_plain(model_spec, steps: int, accum: int, clip: float | None, device: str = "cpu") -> list[float]:
    torch.manual_seed(0)
    model = build(model_spec).to(device)  # initialised on the CPU, as _fresh, so every device starts alike
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    return _loop(model, opt, lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c), steps, accum, clip,
                 device)


def train_tiered(model_spec, steps: int, accum: int, clip: float | None, plan, budgets: Budgets,
                 update: str | None = None, device: str = "cpu") -> tuple[list[float], dict]:
    model, opt = _fresh(model_spec)
    overlap = (update or getattr(plan, "update", "sync")) == "overlap"
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, grad_accum=accum, update=update,
                               max_grad_norm=clip if overlap else None, page_size=64 * 1024)
    try:
        losses = _loop(tm, topt, tm.clip_grad_norm_, steps, accum, clip, device)
    finally:
        tm.runtime.close()
        stats = tm.runtime.mem.stats()
        tm.runtime.mem.close()
    return losses, stats
