"""Parameter counts, training FLOPs and memory per state kind, by formula.

The formulas are checked against the built modules' numel for every named config
(tests/test_models.py), so ``tiertrain info`` can describe a 175B model without
building it. Memory follows ANGEL-PTM Table 1, generalised from fp16 to any compute
precision and from one attention head to ``n_head`` score matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiertrain.models.config import ModelConfig

from tiertrain.precisions import BYTES as PRECISION_BYTES


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one Transformer block."""
    d, f, b = cfg.d_model, cfg.d_ffn, int(cfg.bias)
    norms = 2 * (d + b * d)
    attn = 3 * d * d + 3 * d * b + d * d + d * b
    ffn_one = d * f + f * b + f * d + d * b
    if cfg.is_moe:
        return norms + attn + d * cfg.n_experts + cfg.n_experts * ffn_one
    return norms + attn + ffn_one


def embedding_params(cfg: ModelConfig) -> int:
    """Token and position embeddings, the final norm, and an untied head."""
    d = cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.max_seq_len * d + d + int(cfg.bias) * d + head


def largest_params(cfg: ModelConfig) -> tuple[int, int]:
    """Elements of the largest parameter of a block and of the rest (the embedding or the head)."""
    d = cfg.d_model
    return max(3 * d * d, d * cfg.d_ffn, d * cfg.n_experts), max(cfg.vocab_size, cfg.max_seq_len) * d


def param_count(cfg: ModelConfig) -> int:
    return cfg.n_layer * block_params(cfg) + embedding_params(cfg)


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies with (k of the experts), including the LM head."""
    d, f = cfg.d_model, cfg.d_ffn
    ffn = (cfg.top_k if cfg.is_moe else 1) * 2 * d * f + (d * cfg.n_experts if cfg.is_moe else 0)
    return cfg.n_layer * (4 * d * d + ffn) + cfg.vocab_size * d


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 N_matmul + 12 L d s (PaLM appendix B, attention included)."""
    return 6 * active_matmul_params(cfg) + 12 * cfg.n_layer * cfg.d_model * seq_len


@dataclass(frozen=True)
class StateBytes:
    """Bytes of each state kind for one training step with AdamW."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


def activation_bytes(cfg: ModelConfig, batch: int, seq_len: int, precision: str) -> int:
    """ANGEL-PTM Table 1's activation total per layer, times layers, plus embeddings and logits.

    Table 1 counts fp16 activations and their gradients: 40bsd + 8bs^2 + 8bs*d_ffn per layer.
    We scale by the precision's bytes and by n_head for the two score matrices.
    """
    scale = PRECISION_BYTES[precision] / 2
    b, s, d, f, h = batch, seq_len, cfg.d_model, cfg.d_ffn, cfg.n_head
    k = cfg.top_k if cfg.is_moe else 1
    per_layer = 40 * b * s * d + 8 * b * h * s * s + 8 * b * s * f * k
    edges = 2 * b * s * d + 2 * b * s * cfg.vocab_size  # embedding output, logits (value + grad)
    return int((cfg.n_layer * per_layer + edges) * scale)


def state_bytes(cfg: ModelConfig, batch: int, seq_len: int, precision: str) -> StateBytes:
    """Memory per state kind: compute params and grads in ``precision``; fp32 master
    (only when the compute precision is not fp32) and two fp32 Adam moments."""
    n = param_count(cfg)
    p = PRECISION_BYTES[precision]
    master = 0 if precision == "fp32" else 4
    return StateBytes(params=n * p, grads=n * p, optimizer=n * (master + 8),
                      activations=activation_bytes(cfg, batch, seq_len, precision))


def tier_totals(sb: StateBytes) -> dict[str, dict[str, int]]:
    """What each tier would hold under the two placements that need no planner.

    ``resident``: plain PyTorch, everything on the device. ``optimizer-on-host``:
    ZeRO-Offload's split, optimizer states on host, the rest on the device.
    """
    return {
        "resident": {"device": sb.total, "host": 0},
        "optimizer-on-host": {"device": sb.params + sb.grads + sb.activations, "host": sb.optimizer},
    }
