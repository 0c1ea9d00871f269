"""The reference GPT: pre-LayerNorm, GELU MLP, learned positions, optional tied embeddings.

Kept readable in one file on purpose (nanoGPT's lesson): this is the model every
offloading mode is compared against bit for bit. ``blocks`` is a plain
``nn.ModuleList`` of identical blocks so that the runtime can find and schedule them.
With ``causal=False`` the same code is a BERT-style encoder trained by masked LM.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiertrain.models.config import ModelConfig
from tiertrain.models.moe import MoEFeedForward

IGNORE_INDEX = -100


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.causal = cfg.causal
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # a tensor-parallel rank's qkv holds its heads of each
        width = q.shape[-1]
        q, k, v = (t.view(b, s, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, s, width))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ffn, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_ffn, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One Transformer layer: the unit the runtime schedules."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.ffn = MoEFeedForward(cfg) if cfg.is_moe else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.ffn(self.ln2(x)))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not -100 (the whole model's, and a pipeline's last stage's)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits, or the mean cross-entropy loss when ``targets`` is given.

        Targets equal to -100 are ignored (masked-LM positions that were not masked).
        MoE models add their load-balancing loss to the returned loss.
        """
        s = idx.shape[1]
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = token_loss(logits, targets)
        if self.config.is_moe:
            loss = loss + self.config.aux_loss_coef * self.moe_aux_loss()
        return loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, do_sample: bool = False) -> torch.Tensor:
        """Continue each row of ``idx`` by ``max_new_tokens`` tokens (nanoGPT's loop, no KV cache): the
        most likely token each time, or with ``do_sample`` one drawn at ``temperature`` from the
        ``top_k`` most likely. Only the last ``max_seq_len`` tokens are seen."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.max_seq_len:])[:, -1, :].float()
            if not do_sample:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    def moe_aux_loss(self) -> torch.Tensor:
        """Mean over blocks of the last forward's Switch load-balancing loss."""
        losses = [blk.ffn.last_aux_loss for blk in self.blocks]
        return torch.stack(losses).mean()
