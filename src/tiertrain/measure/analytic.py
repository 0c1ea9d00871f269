"""Per-block figures from a model's shape alone: its work (FLOPs, bytes) and sizes, and the times that
work takes at a machine's rates. What planning falls back to for a model none of whose blocks can
run here, what scales a block measured at a reduced shape up to the run's, and what ``--machine``
and ``--max-model`` plan from for hardware we do not have.

Work of one forward of our GPT block at batch b, sequence s: matrix products 2 b s (4 d^2 + 2 d f k)
FLOPs, attention scores and their weighted sum 4 b s^2 d; backward twice the forward. Element-wise
traffic: every tensor autograd saves is written by one op and read by the next (2x the saved bytes).
Times are ``planner.machine.compute_seconds`` of that work (a roofline at the machine's rates).

Saved activations are what our block's autograd keeps (counted, and checked by the tests against a
real block): in fp32 4 (8d + 2f + h + 4) bytes per token (layer norms' inputs and statistics, the
matrix products' inputs, q/k/v and the attention output, softmax statistics per head; scaled dot
product attention keeps no s x s scores); under bf16/fp16 autocast 20d + 4f + 4h + 16 per token (the
16-bit copies autocast makes of fp32 matrices are not counted: a tiered run computes with 16-bit
parameters in their slots, ``measure.model._SavedBytes``). ANGEL-PTM Table 1's 34bsd + 5bs^2h counts an attention
that keeps its scores: 3.4x ours for GPT3-175B at s=2048. A mixture-of-experts block keeps Table 1's.
The rest block (embeddings, head) costs its head's matrix product.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

from tiertrain.measure.machine import probe
from tiertrain.models.accounting import block_params, embedding_params, largest_params
from tiertrain.models.config import ModelConfig
from tiertrain.planner.machine import Machine, compute_seconds
from tiertrain.planner.profile import BlockProfile, Profile
from tiertrain.precisions import BYTES
from tiertrain.runtime.blocks import Block

HIDDEN_BYTES = 4  # a block's input is the fp32 residual stream, also under autocast


@dataclass(frozen=True)
class Work:
    """One forward of a block: FLOPs of its matrix products and attention, bytes its weights take in
    the compute precision, and its element-wise memory traffic."""

    flops: float
    weight_bytes: float
    traffic_bytes: float

    def seconds(self, m: Machine, dtype: str) -> float:
        return compute_seconds(self.flops, self.weight_bytes, self.traffic_bytes, m, dtype)


def saved_bytes(cfg: ModelConfig, batch: int, seq: int, precision: str) -> int:
    """What one of our blocks' autograd keeps between forward and backward (see the module's note)."""
    d, f, h, tokens = cfg.d_model, cfg.d_ffn, cfg.n_head, batch * seq
    if cfg.is_moe:  # ANGEL-PTM Table 1, in the run's precision
        return int((34 * tokens * d + 5 * batch * seq * seq * h) * BYTES[precision] / 2)
    if precision == "fp32":
        return tokens * 4 * (8 * d + 2 * f + h + 4)
    return tokens * (20 * d + 4 * f + 4 * h + 16)


def block_work(cfg: ModelConfig, batch: int, seq: int, precision: str) -> Work:
    d, k = cfg.d_model, cfg.top_k if cfg.is_moe else 1
    matmul = 4 * d * d + 2 * d * cfg.d_ffn * k + (d * cfg.n_experts if cfg.is_moe else 0)
    flops = 2 * matmul * batch * seq + 4 * batch * seq * seq * d
    return Work(flops, block_params(cfg) * BYTES[precision], 2 * saved_bytes(cfg, batch, seq, precision))


def rest_work(cfg: ModelConfig, batch: int, seq: int, precision: str) -> Work:
    """The head's product and its logits (written, read by the loss, their gradient written)."""
    head = cfg.vocab_size * cfg.d_model
    return Work(2 * head * batch * seq, head * BYTES[precision], 3 * batch * seq * cfg.vocab_size * 4)


def _profile(name: str, w: Work, m: Machine, dtype: str, params: int, act: int, hidden: int) -> BlockProfile:
    fwd = w.seconds(m, dtype)
    return BlockProfile(name, fwd, 2 * fwd, params, act, hidden, flops=w.flops, traffic_bytes=w.traffic_bytes)


def analytic_blocks(cfg: ModelConfig, batch: int, seq: int, precision: str,
                    machine: Machine) -> tuple[list[BlockProfile], BlockProfile]:
    """One of our models' blocks and rest block, their times at ``machine``'s rates."""
    act, hidden = saved_bytes(cfg, batch, seq, precision), batch * seq * cfg.d_model * HIDDEN_BYTES
    largest, largest_rest = largest_params(cfg)
    one = _profile("", block_work(cfg, batch, seq, precision), machine, precision, block_params(cfg), act, hidden)
    blocks = [BlockProfile(f"blocks.{i}", one.forward_s, one.backward_s, one.params, act, hidden, flops=one.flops,
                           traffic_bytes=one.traffic_bytes, largest=largest) for i in range(cfg.n_layer)]
    logits = 2 * batch * seq * cfg.vocab_size * BYTES[precision]
    rest = _profile("rest", rest_work(cfg, batch, seq, precision), machine, precision, embedding_params(cfg),
                    logits, hidden)
    return blocks, dataclasses.replace(rest, largest=largest_rest)


def analytic_profile(cfg: ModelConfig, batch: int, seq: int, precision: str = "fp32", disk_dir: str | None = None,
                     machine: Machine | None = None) -> Profile:
    """The FLOP-and-bytes estimate of one of our models at ``machine``'s rates (default: this one's, probed)."""
    machine = machine or probe(disk_dir)
    blocks, rest = analytic_blocks(cfg, batch, seq, precision, machine)
    how = (f"FLOP estimate at {machine.name}'s rates ({machine.matmul(precision) / 1e9:.0f} GFLOP/s {precision} "
           f"matmul, {machine.memory_bps / 1e9:.0f} GB/s memory)")
    return Profile(tuple(blocks), rest, machine.rates(), compute_dtype=precision, page=machine.page_size,
                   key=f"{socket.gethostname()}/{cfg.name or 'model'}/b{batch}s{seq}/{precision}/analytic", source=how)


def generic_work(blocks: list[Block], shape: tuple[int, int], d: int, heads: int, precision: str) -> Work:
    """A block of a model without one of our configs (a transformers model), from its matrices:
    2 FLOPs per weight per token plus attention scores; its saved bytes guessed as our block's
    with a 4x MLP and an attention that keeps its scores (a bound for the memory a run may take)."""
    b, s = shape
    matrices = sum(p.numel() for _, p in blocks[0].params if p.dim() >= 2)
    act = b * s * 4 * (16 * d + 2 * heads * s)
    return Work(2 * matrices * b * s + 4 * b * s * s * d, matrices * BYTES[precision], 2 * act)


def generic_rest(blocks: list[Block], shape: tuple[int, int], d: int, precision: str) -> tuple[Work, BlockProfile]:
    """The rest block of such a model: its largest matrix taken as the output head (embedding lookups
    cost next to nothing); the profile's times are left for the caller to set."""
    b, s = shape
    head = max((p.numel() for _, p in blocks[-1].params if p.dim() >= 2), default=0)
    vocab = head // max(d, 1)
    params = sum(p.numel() for _, p in blocks[-1].params)
    work = Work(2 * head * b * s, head * BYTES[precision], 3 * b * s * vocab * 4)
    rest = BlockProfile("rest", 0.0, 0.0, params, 2 * b * s * vocab * BYTES[precision], b * s * d * HIDDEN_BYTES,
                        flops=work.flops, traffic_bytes=work.traffic_bytes,
                        largest=max((p.numel() for _, p in blocks[-1].params), default=0))
    return work, rest
