"""Our GPT's tensor-parallel plan: in each block, attention's heads and the MLP's hidden features split
over the group (Megatron's layout: qkv and fc column-parallel, both projections row-parallel), norms,
embeddings and head whole on every rank.

A whole parameter's gradient is then the same on every rank of the group (its inputs and the gradients
reaching it are the group's sums), so the whole parameters of the ranks stay equal step after step
without any exchange of their own; a rank's share of a block's states is 1/T of its matrices and
qkv's and fc's biases, plus the whole norms and projection biases (6 x d_model values).
"""

from __future__ import annotations

import re

from torch import nn

from tiertrain.errors import ConfigError
from tiertrain.models.config import ModelConfig
from tiertrain.models.gpt import GPT, Block
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.tensor_layers import (
    COLUMNS,
    ROWS,
    Split,
    column_parallel,
    row_parallel,
)
from tiertrain.parallel.tensor_start import drawn_whole, group_seed, same_start

SUPPORTED = "tiertrain's GPT (--model tiny/small/... or a config JSON without experts)"
QKV = Split(0, parts=3)  # q, k and v rows: each rank takes its heads of all three
SPLITS = {"attn.qkv.weight": QKV, "attn.qkv.bias": QKV, "attn.proj.weight": ROWS,
          "ffn.fc.weight": COLUMNS, "ffn.fc.bias": COLUMNS, "ffn.proj.weight": ROWS}
_IN_BLOCK = re.compile(r"^blocks\.\d+\.(.+)$")


def split_of(name: str) -> Split | None:
    """How the parameter ``name`` (the whole model's name) is cut over a tensor-parallel group; None where
    every rank holds it whole."""
    m = _IN_BLOCK.match(name)
    return SPLITS.get(m.group(1)) if m else None


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Refuse, in one line, a model this plan cannot cut into ``tp`` shards."""
    if not isinstance(model, GPT):
        raise ConfigError(f"tensor parallel (--tp) has a parallelize plan for {SUPPORTED} only; got "
                          f"{type(model).__name__}: train it with data or pipeline parallel (--nproc, --pp) instead")
    cfg = model.config
    if cfg.is_moe:
        raise ConfigError("tensor parallel does not cut a mixture-of-experts model yet: divide its experts over the "
                          "ranks with --ep instead")
    if cfg.dropout:
        raise ConfigError(f"tensor parallel needs dropout 0 (got {cfg.dropout}): the ranks of a group draw no common "
                          "dropout masks yet; set \"dropout\": 0 in the model's config")
    for what, n in (("attention heads (n_head)", cfg.n_head), ("MLP features (d_ffn)", cfg.d_ffn)):
        if n % tp:
            raise ConfigError(f"--tp {tp} must divide the model's {what}, {n}: choose a --tp that divides it")


def parallelize_gpt(model: GPT, rank: int, group: Collectives) -> dict[int, nn.Parameter]:
    """Cut ``model``'s blocks in place into this rank's shards, every rank of ``group`` from the same whole
    model (``parallel.tensor_start``); returns each replaced parameter's new one by the old one's ``id``
    (an optimizer built over the whole model is pointed at them)."""
    check_tensor_parallel(model, group.world_size)
    seed = group_seed(group)
    same_start(model, group, seed)
    return parallelize_blocks(model.blocks, rank, group, seed)


def parallelize_blocks(blocks: nn.ModuleList, rank: int, group: Collectives, seed: int,
                       first: int = 0) -> dict[int, nn.Parameter]:
    """``parallelize_gpt`` of some of a checked model's blocks (a pipeline stage's: ``first`` is the index
    of its first block in the model), each alike on every rank of ``group`` already but for its matrices
    on the meta device, drawn whole here from ``seed`` one block at a time."""
    new_of: dict[int, nn.Parameter] = {}
    for j, block in enumerate(blocks):
        attn, ffn = block.attn, block.ffn
        for sub, linear in (("attn.qkv", attn.qkv), ("attn.proj", attn.proj), ("ffn.fc", ffn.fc),
                            ("ffn.proj", ffn.proj)):
            for pname, p in linear.named_parameters():
                if p.is_meta:
                    drawn_whole(f"blocks.{first + j}.{sub}.{pname}", p, seed)
        swaps = [(attn, "qkv", column_parallel(attn.qkv, QKV, rank, group)),
                 (attn, "proj", row_parallel(attn.proj, rank, group)),
                 (ffn, "fc", column_parallel(ffn.fc, COLUMNS, rank, group)),
                 (ffn, "proj", row_parallel(ffn.proj, rank, group))]
        for parent, name, cut in swaps:
            old = getattr(parent, name)
            for pname, p in old.named_parameters():
                new_of[id(p)] = getattr(cut, pname)
            setattr(parent, name, cut)
        attn.n_head //= group.world_size
    return new_of


def whole_per_block(cfg: ModelConfig) -> int:
    """Elements of one block that every rank of a group holds whole (norms, projection biases), as the plan
    above cuts it: what the planner keeps whole per rank (``planner.tensor``)."""
    import torch

    with torch.device("meta"):
        block = Block(cfg)
    return sum(p.numel() for name, p in block.named_parameters() if name not in SPLITS)
