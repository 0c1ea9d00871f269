import pytest
import torch

from tiertrain.errors import ConfigError
from tiertrain.models import CONFIGS, GPT, ModelConfig, build, param_count, resolve_config
from tiertrain.models.accounting import activation_bytes, flops_per_token, state_bytes


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_formula_matches_numel(name):
    model = build(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == param_count(CONFIGS[name])


def test_block_list_is_plain_modulelist_of_equal_blocks():
    for name in ("tiny", "tiny-moe", "tiny-bert"):
        model = build(name)
        assert type(model.blocks) is torch.nn.ModuleList
        shapes = [[(n, p.shape) for n, p in b.named_parameters()] for b in model.blocks]
        assert all(s == shapes[0] for s in shapes)


def test_untied_head_adds_parameters():
    tied = CONFIGS["tiny"]
    untied = ModelConfig(**{**tied.to_dict(), "tie_embeddings": False})
    m = build(untied)
    assert m.lm_head.weight is not m.tok_emb.weight
    assert param_count(untied) - param_count(tied) == tied.vocab_size * tied.d_model
    assert sum(p.numel() for p in m.parameters()) == param_count(untied)


def test_decoder_is_causal_and_encoder_is_not():
    torch.manual_seed(0)
    x = torch.randint(0, 200, (1, 16))
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % 200
    dec, enc = build("tiny").eval(), build("tiny-bert").eval()
    # Changing the last token must not change a decoder's earlier logits, but must change an encoder's.
    assert torch.equal(dec(x)[0, :-1], dec(x2)[0, :-1])
    assert not torch.equal(enc(x)[0, :-1], enc(x2)[0, :-1])


def test_moe_routes_tokens_to_top_k_experts_and_every_expert_can_learn():
    torch.manual_seed(0)
    model = build("tiny-moe")
    x = torch.randint(0, 256, (4, 32))
    loss = model(x, x)
    loss.backward()
    ffn = model.blocks[0].ffn
    assert ffn.last_aux_loss.item() > 0
    got_grad = [e.fc.weight.grad is not None and e.fc.weight.grad.abs().sum() > 0 for e in ffn.experts]
    assert sum(got_grad) >= 2  # top-2 of 4 experts over 128 tokens reaches several experts


def test_flops_per_token_matches_6n_rule_for_a_known_model():
    cfg = CONFIGS["gpt3-175b"]
    f = flops_per_token(cfg, 2048)
    # Dominated by 6 N: within 5% of 6 * parameter count.
    assert abs(f / (6 * param_count(cfg)) - 1) < 0.05
    moe = CONFIGS["moe-4b"]
    assert flops_per_token(moe, 512) < 6 * param_count(moe) / 3  # top-1 of 8 experts is active


def test_activation_bytes_follow_angel_ptm_table_1():
    """fp16, one head, no embeddings: per layer 40bsd + 8bs^2 + 8bs*d_ffn (ANGEL-PTM Table 1)."""
    cfg = ModelConfig(n_layer=1, n_head=1, d_model=64, d_ffn=256, vocab_size=1, max_seq_len=128)
    b, s, d, f = 2, 128, 64, 256
    edges = 2 * b * s * d + 2 * b * s * 1
    assert activation_bytes(cfg, b, s, "fp16") == 40 * b * s * d + 8 * b * s * s + 8 * b * s * f + edges
    sb = state_bytes(cfg, b, s, "fp16")
    n = param_count(cfg)
    assert (sb.params, sb.grads, sb.optimizer) == (2 * n, 2 * n, 12 * n)  # Table 1: 4 B params+grads, 12 B optims
    assert state_bytes(cfg, b, s, "fp32").optimizer == 8 * n  # fp32: the params are the master copy


def test_resolve_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="did you mean gpt3-13b"):
        resolve_config("gpt3-13")
    with pytest.raises(ConfigError, match="unknown model field"):
        resolve_config({"n_layer": 1, "bogus": 2})
    with pytest.raises(ConfigError, match="not divisible"):
        ModelConfig(n_layer=1, n_head=3, d_model=64, d_ffn=64, vocab_size=10, max_seq_len=8)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(str(tmp_path / "missing.json"))


def test_build_from_dict_and_file(tmp_path):
    import json

    d = {**CONFIGS["tiny"].to_dict(), "name": "mine"}
    (tmp_path / "m.json").write_text(json.dumps(d))
    assert isinstance(build(str(tmp_path / "m.json")), GPT)
    assert build(d).config.name == "mine"
