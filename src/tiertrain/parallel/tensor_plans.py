"""The parallelize plans: where each supported architecture's blocks are, and how each of their linear
layers is cut over a tensor-parallel group (Megatron's layout: attention's heads and the MLP's hidden
features split; q, k, v and the MLP's first layers column-parallel, both projections row-parallel);
norms, embeddings and head whole on every rank.

A whole parameter's gradient is then the same on every rank of the group (its inputs and the gradients
reaching it are the group's sums), so the whole parameters of the ranks stay equal step after step without
an exchange of their own; a rank's share of a block's states is 1/T of its matrices and column biases, plus
the whole norms and projection biases. The layers' inputs are entered once per shared input (one sum of
their gradients backward for q, k and v together, one for an MLP's two first layers), as Megatron's fused
layers do.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
from torch import nn

from tiertrain.errors import ConfigError
from tiertrain.models.config import ModelConfig
from tiertrain.models.gpt import GPT, Block
from tiertrain.models.hf_stages import FAMILIES, is_decoder
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.tensor_layers import (
    COLUMNS,
    ROWS,
    Split,
    column_parallel,
    row_parallel,
)
from tiertrain.parallel.tensor_ops import enter_region
from tiertrain.parallel.tensor_start import (
    back_to_meta,
    drawn_whole,
    group_seed,
    same_start,
)

SUPPORTED = ("tiertrain's GPT (--model tiny/small/... or a config JSON without experts) and transformers "
             f"decoders built as {', '.join(FAMILIES)}")
QKV = Split(0, parts=3)  # our fused q, k and v rows: each rank takes its heads of all three


@dataclass(frozen=True)
class Cut:
    """One linear layer of a block: its place, and its weight's cut (dim 0: column-parallel)."""

    path: str
    split: Split

    @property
    def column(self) -> bool:
        return self.split.dim == 0


@dataclass(frozen=True)
class TensorPlan:
    """An architecture's parallelize plan: its blocks' place, their layers' cuts, the modules whose input
    the column-parallel layers in them share (entered once), and the attribute counting a block's heads
    (divided by the group's size; None where the forward reads the heads from the weights' shapes)."""

    blocks_at: str
    cuts: tuple[Cut, ...]
    shared_inputs: tuple[str, ...] = ()
    heads_attr: str | None = None

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return operator.attrgetter(self.blocks_at)(model)

    def split_of(self, name: str) -> Split | None:
        m = re.match(rf"^{re.escape(self.blocks_at)}\.\d+\.(.+)\.(weight|bias)$", name)
        cut = next((c for c in self.cuts if m and c.path == m.group(1)), None)
        if cut is None or (m.group(2) == "bias" and not cut.column):
            return None
        return cut.split if m.group(2) == "weight" else Split(0, cut.split.parts)


GPT_PLAN = TensorPlan("blocks", (Cut("attn.qkv", QKV), Cut("attn.proj", ROWS), Cut("ffn.fc", COLUMNS),
                                 Cut("ffn.proj", ROWS)), heads_attr="attn.n_head")
DECODER_PLAN = TensorPlan("model.layers", (
    Cut("self_attn.q_proj", COLUMNS), Cut("self_attn.k_proj", COLUMNS), Cut("self_attn.v_proj", COLUMNS),
    Cut("self_attn.o_proj", ROWS), Cut("mlp.gate_proj", COLUMNS), Cut("mlp.up_proj", COLUMNS),
    Cut("mlp.down_proj", ROWS)), shared_inputs=("self_attn", "mlp"))
PLANS = (GPT_PLAN, DECODER_PLAN)


def split_of(name: str) -> Split | None:
    """How the parameter ``name`` (the whole model's name) is cut over a tensor-parallel group; None where
    every rank holds it whole."""
    return next((s for s in (p.split_of(name) for p in PLANS) if s is not None), None)


def check_tensor_parallel(model: nn.Module, tp: int) -> TensorPlan:
    """``model``'s plan; refused, in one line, where none can cut it into ``tp`` shards."""
    if isinstance(model, GPT):
        cfg = model.config
        if cfg.is_moe:
            raise ConfigError("tensor parallel does not cut a mixture-of-experts model yet: divide its experts over "
                              "the ranks with --ep instead")
        _check_counts(tp, cfg.dropout, (("attention heads (n_head)", cfg.n_head), ("MLP features (d_ffn)", cfg.d_ffn)))
        return GPT_PLAN
    if is_decoder(model):
        cfg = model.config
        heads = cfg.num_attention_heads
        _check_counts(tp, cfg.attention_dropout, (
            ("attention heads (num_attention_heads)", heads),
            ("key-value heads (num_key_value_heads)", getattr(cfg, "num_key_value_heads", None) or heads),
            ("MLP features (intermediate_size)", cfg.intermediate_size)))
        return DECODER_PLAN
    raise ConfigError(f"tensor parallel (--tp) has a parallelize plan for {SUPPORTED} only; got "
                      f"{type(model).__name__}: train it with data or pipeline parallel (--nproc, --pp) instead")


def _check_counts(tp: int, dropout: float, counts: tuple[tuple[str, int], ...]) -> None:
    if dropout:
        raise ConfigError(f"tensor parallel needs dropout 0 (got {dropout}): the ranks of a group draw no common "
                          "dropout masks yet; set it to 0 in the model's config")
    for what, n in counts:
        if n % tp:
            raise ConfigError(f"--tp {tp} must divide the model's {what}, {n}: choose a --tp that divides it")


def parallelize(model: nn.Module, rank: int, group: Collectives) -> dict[int, nn.Parameter]:
    """Cut ``model``'s blocks in place into this rank's shards, every rank of ``group`` from the same whole
    model (``parallel.tensor_start``); returns each replaced parameter's new one by the old one's ``id``
    (an optimizer built over the whole model is pointed at them)."""
    plan = check_tensor_parallel(model, group.world_size)
    if plan is DECODER_PLAN and any(b.is_meta for b in model.buffers()):
        raise ConfigError(f"a {type(model).__name__} built on the meta device cannot be cut over tensor-parallel "
                          "ranks yet (its rotary frequencies are not drawn): build it in memory (a larger "
                          "--host-memory)")
    seed = group_seed(group)
    same_start(model, group, seed, plan.blocks_at)
    return parallelize_blocks(plan, plan.blocks(model), rank, group, seed)


def parallelize_blocks(plan: TensorPlan, blocks: nn.ModuleList, rank: int, group: Collectives, seed: int,
                       first: int = 0) -> dict[int, nn.Parameter]:
    """``parallelize`` of some of a checked model's blocks (a pipeline stage's: ``first`` is the index of
    its first block in the model), each alike on every rank of ``group`` already but for its matrices on
    the meta device, drawn whole here from ``seed`` one block at a time."""
    new_of: dict[int, nn.Parameter] = {}
    for j, block in enumerate(blocks):
        for cut in plan.cuts:
            parent_path, _, attr = cut.path.rpartition(".")
            parent = operator.attrgetter(parent_path)(block) if parent_path else block
            linear = getattr(parent, attr)
            drawn = [p for p in linear.parameters() if p.is_meta]
            for pname, p in linear.named_parameters():
                if p.is_meta:
                    drawn_whole(f"{plan.blocks_at}.{first + j}.{cut.path}.{pname}", p, seed)
            enters = not plan.shared_inputs
            new = (column_parallel(linear, cut.split, rank, group, enters) if cut.column
                   else row_parallel(linear, rank, group))
            for pname, p in linear.named_parameters():
                new_of[id(p)] = getattr(new, pname)
            for p in drawn:
                back_to_meta(p)
            setattr(parent, attr, new)
        for path in plan.shared_inputs:
            operator.attrgetter(path)(block).register_forward_pre_hook(_entered(group), with_kwargs=True)
        if plan.heads_attr is not None:
            owner_path, _, attr = plan.heads_attr.rpartition(".")
            owner = operator.attrgetter(owner_path)(block)
            setattr(owner, attr, getattr(owner, attr) // group.world_size)
    return new_of


def _entered(group: Collectives):
    """A pre-hook entering a module's input (its first argument, or ``hidden_states``) into the cut region
    once, for every column-parallel layer reading it."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (enter_region(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter_region(kwargs["hidden_states"], group)}
    return hook


def whole_per_block(cfg: ModelConfig) -> int:
    """Elements of one block of our GPT that every rank of a group holds whole (norms, projection biases),
    as its plan cuts it: what the planner keeps whole per rank (``planner.tensor``)."""
    with torch.device("meta"):
        block = Block(cfg)
    return sum(p.numel() for name, p in block.named_parameters() if GPT_PLAN.split_of(f"blocks.0.{name}") is None)
