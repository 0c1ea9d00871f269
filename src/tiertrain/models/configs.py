"""Named model configurations taken from the papers tiertrain implements.

Where a paper's table cannot be built as written, the deviation is stated here:

- GPT3-13B (ANGEL-PTM Table 4): d_model 5140 / d_ffn 20506 is the well-known typo of the
  GPT-3 paper; 5140 is not divisible by 40 heads. We use GPT-3's real 5120 / 20480.
- GPT3-30B (ANGEL-PTM Table 4): 36 heads do not divide d_model 8192; we use 32 heads
  (head dim 256). Heads do not change the parameter count.
- BERT-* (H3T Table 2): layers, d_hidden, d_ffn and heads as given; vocabulary 30522
  and sequence 512 as BERT; pre-LayerNorm like our GPT, bidirectional, masked-LM.
  Our counts: 1.84B, 6.68B, 13.8B, 102B, matching H3T's column.
- OPT-* (Elixir): shapes from the OPT paper (Zhang et al. 2022), vocabulary 50272, with
  our GELU MLP in place of OPT's ReLU (same parameter count).
- GPT-3 14B/18B/39B/81B (FOLD3D Table 1): d_ffn = 4 d_model, vocabulary 50257, seq 2048.
- Names are the papers'; our counts follow their shapes, so gpt3-28b counts 21.4B and
  gpt3-30b 52.0B (ANGEL-PTM's table lists these shapes under those names).
- moe-4b: ANGEL-PTM's T5-MoE block shape (16 x 1024, d_ffn 16384) with 8 experts, top-1.
"""

from __future__ import annotations

from tiertrain.models.config import ModelConfig


def _gpt3(name: str, layers: int, heads: int, d: int, ffn: int) -> ModelConfig:
    return ModelConfig(n_layer=layers, n_head=heads, d_model=d, d_ffn=ffn,
                       vocab_size=50257, max_seq_len=2048, name=name)


def _bert(name: str, layers: int, heads: int, d: int, ffn: int) -> ModelConfig:
    return ModelConfig(n_layer=layers, n_head=heads, d_model=d, d_ffn=ffn, vocab_size=30522,
                       max_seq_len=512, causal=False, name=name)


def _opt(name: str, layers: int, heads: int, d: int) -> ModelConfig:
    return ModelConfig(n_layer=layers, n_head=heads, d_model=d, d_ffn=4 * d,
                       vocab_size=50272, max_seq_len=2048, name=name)


_ALL = [
    # ANGEL-PTM Table 4
    _gpt3("gpt3-1.7b", 24, 24, 2304, 9216),
    _gpt3("gpt3-13b", 40, 40, 5120, 20480),
    _gpt3("gpt3-28b", 26, 128, 8192, 32768),
    _gpt3("gpt3-30b", 64, 32, 8192, 32768),
    _gpt3("gpt3-55b", 68, 128, 8192, 32768),
    _gpt3("gpt3-120b", 64, 96, 12288, 49152),
    _gpt3("gpt3-175b", 70, 112, 14336, 57344),
    # FOLD3D Table 1
    _gpt3("gpt3-14b", 32, 48, 6144, 4 * 6144),
    _gpt3("gpt3-18b", 40, 48, 6144, 4 * 6144),
    _gpt3("gpt3-39b", 48, 64, 8192, 4 * 8192),
    _gpt3("gpt3-81b", 64, 80, 10240, 4 * 10240),
    # H3T Table 2
    _bert("bert-1.8b", 48, 32, 1024, 16384),
    _bert("bert-6b", 48, 128, 1024, 65536),
    _bert("bert-13b", 48, 128, 2048, 65536),
    _bert("bert-100b", 56, 96, 12288, 49152),
    # Elixir's OPT shapes
    _opt("opt-1.3b", 24, 32, 2048),
    _opt("opt-2.7b", 32, 32, 2560),
    _opt("opt-6.7b", 32, 32, 4096),
    _opt("opt-13b", 40, 40, 5120),
    _opt("opt-30b", 48, 56, 7168),
    # Switch/T5-MoE style, for expert-parallel work (ANGEL-PTM's T5-MoE block shape, 8 experts).
    ModelConfig(n_layer=16, n_head=16, d_model=1024, d_ffn=16384, vocab_size=32128,
                max_seq_len=512, n_experts=8, top_k=1, name="moe-4b"),
    # Small models that train on a CPU.
    ModelConfig(n_layer=4, n_head=4, d_model=256, d_ffn=1024, vocab_size=256,
                max_seq_len=256, name="gpt-small"),
    ModelConfig(n_layer=2, n_head=2, d_model=32, d_ffn=128, vocab_size=256,
                max_seq_len=64, name="tiny"),
    ModelConfig(n_layer=2, n_head=2, d_model=32, d_ffn=64, vocab_size=256,
                max_seq_len=64, n_experts=4, top_k=2, name="tiny-moe"),
    ModelConfig(n_layer=2, n_head=2, d_model=32, d_ffn=128, vocab_size=256,
                max_seq_len=64, causal=False, name="tiny-bert"),
]

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in _ALL}
DEFAULT_MODEL = "gpt-small"
