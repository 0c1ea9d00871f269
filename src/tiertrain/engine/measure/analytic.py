"""Per-block figures from a model's shape alone, at this machine's measured rates: what planning
falls back to for a model none of whose blocks can run here.

Forward: 2 FLOPs per weight per token, plus attention scores; backward twice that; saved
activations per ANGEL-PTM Table 1 (34bsd + 5bs^2h for a block, in the run's precision), a block's
input b*s*d. The rest block (embeddings, head) costs its output head's matrix product.
"""

from __future__ import annotations

import socket

from tiertrain.engine.measure.machine import probe_machine
from tiertrain.models.accounting import block_params, embedding_params
from tiertrain.models.config import ModelConfig
from tiertrain.planner.profile import BlockProfile, Profile
from tiertrain.precisions import BYTES
from tiertrain.runtime.blocks import Block


def analytic_blocks(cfg: ModelConfig, batch: int, seq: int, precision: str, flops: float) -> tuple[list[BlockProfile], BlockProfile]:
    """One of our models' blocks and rest block, at ``flops`` FLOP/s."""
    nbytes = BYTES[precision]
    b, s, d, h = batch, seq, cfg.d_model, cfg.n_head
    params = block_params(cfg)
    k = cfg.top_k if cfg.is_moe else 1
    matmul = 4 * d * d + 2 * d * cfg.d_ffn * k
    fwd = (2 * matmul * b * s + 4 * b * s * s * d) / flops
    act = int((34 * b * s * d + 5 * b * s * s * h) * nbytes / 2)
    blocks = [BlockProfile(f"blocks.{i}", fwd, 2 * fwd, params, act, b * s * d * nbytes) for i in range(cfg.n_layer)]
    rest_p = embedding_params(cfg)
    head = 2 * cfg.vocab_size * d * b * s / flops
    rest = BlockProfile("rest", head, 2 * head, rest_p, 2 * b * s * cfg.vocab_size * nbytes, b * s * d * nbytes)
    return blocks, rest


def analytic_profile(cfg: ModelConfig, batch: int, seq: int, precision: str = "fp32",
                     disk_dir: str | None = None) -> Profile:
    machine, flops = probe_machine(disk_dir)
    blocks, rest = analytic_blocks(cfg, batch, seq, precision, flops)
    return Profile(tuple(blocks), rest, machine, compute_dtype=precision,
                   key=f"{socket.gethostname()}/{cfg.name or 'model'}/b{batch}s{seq}/{precision}/analytic")


def flop_estimate(blocks: list[Block], shape: tuple[int, int], d: int, precision: str,
                  flops: float) -> tuple[float, BlockProfile]:
    """A model without one of our configs (a transformers model): a block's forward seconds from its
    matrices (2 FLOPs per weight per token, plus attention scores), and the rest block's from its
    largest matrix, the output head (embedding lookups cost next to nothing)."""
    b, s = shape
    nbytes = BYTES[precision]
    matrices = sum(p.numel() for _, p in blocks[0].params if p.dim() >= 2)
    block_s = (2 * matrices * b * s + 4 * b * s * s * d) / flops
    head = max((p.numel() for _, p in blocks[-1].params if p.dim() >= 2), default=0)
    rest_s = 2 * head * b * s / flops
    params = sum(p.numel() for _, p in blocks[-1].params)
    rest = BlockProfile("rest", rest_s, 2 * rest_s, params, 2 * b * s * (head // max(d, 1)) * nbytes, b * s * d * nbytes)
    return block_s, rest
