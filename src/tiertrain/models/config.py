"""The shape of a reference model, as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from tiertrain.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a GPT-style Transformer (decoder, or encoder when ``causal`` is False).

    ``n_experts > 0`` turns every block's feed-forward into a top-``top_k`` gated
    mixture of experts (Switch / T5-MoE style). Every block then has the same
    structure, which is what the runtime's block finder relies on.
    """

    n_layer: int
    n_head: int
    d_model: int
    d_ffn: int
    vocab_size: int
    max_seq_len: int
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    causal: bool = True
    n_experts: int = 0
    top_k: int = 1
    aux_loss_coef: float = 0.01
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("n_layer", "n_head", "d_model", "d_ffn", "vocab_size", "max_seq_len"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model {f} must be positive, got {getattr(self, f)}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "choose n_head so that d_model / n_head is a whole number"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown model field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}"
            )
        try:
            return cls(**data)
        except TypeError as exc:  # a required field is missing
            raise ConfigError(f"model config incomplete: {exc}") from None
