"""The shape of a reference model, as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tiertrain import typed
from tiertrain.errors import ConfigError
from tiertrain.typed import at_least, between


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a GPT-style Transformer (decoder, or encoder when ``causal`` is False).

    ``n_experts > 0`` turns every block's feed-forward into a top-``top_k`` gated
    mixture of experts (Switch / T5-MoE style). Every block then has the same
    structure, which is what the runtime's block finder relies on.
    """

    n_layer: int = field(metadata=at_least(1))
    n_head: int = field(metadata=at_least(1))
    d_model: int = field(metadata=at_least(1))
    d_ffn: int = field(metadata=at_least(1))
    vocab_size: int = field(metadata=at_least(1))
    max_seq_len: int = field(metadata=at_least(1))
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = field(default=0.0, metadata=between(0, 1, high_open=True))
    causal: bool = True
    n_experts: int = field(default=0, metadata=at_least(0))
    top_k: int = field(default=1, metadata=at_least(1))
    aux_loss_coef: float = field(default=0.01, metadata=at_least(0))
    name: str = ""

    def __post_init__(self) -> None:
        typed.check(self, "model")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "choose n_head so that d_model / n_head is a whole number"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return typed.load(cls, data, "model")
