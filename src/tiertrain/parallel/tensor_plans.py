"""The parallelize plans, as data: where each supported architecture's blocks are, and how each of their
linear layers is cut over a tensor-parallel group (Megatron's layout: attention's heads and the MLP's hidden
features split; q, k, v and the MLP's first layers column-parallel, both projections row-parallel, each
expert of a mixture-of-experts layer alike); norms, embeddings, routers and head whole on every rank.

A whole parameter's gradient is then the same on every rank of the group (its inputs and the gradients
reaching it are the group's sums), so the whole parameters of the ranks stay equal step after step without
an exchange of their own; a rank's share of a block's states is 1/T of its matrices and column biases, plus
the whole norms and projection biases. Where several column-parallel layers read one input (q, k and v;
an MLP's gate and up) it is entered once (one sum of their gradients backward), as Megatron's fused layers
do. A parameter's cut is known from its name alone (``split_of``), so a checkpoint is merged and cut again
without the model.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass

import torch
from torch import nn

from tiertrain.errors import ConfigError
from tiertrain.models.config import ModelConfig
from tiertrain.models.gpt import GPT
from tiertrain.models.stages import tied_head
from tiertrain.parallel.tensor_layers import Split


@dataclass(frozen=True)
class Cut:
    """One linear layer of a block: its place (``*``: any index, an expert's), whether it is column-parallel
    (its output features split) or row-parallel (its input features), and the parts of a fused weight (our
    GPT's and GPT-2's q, k and v in one: each rank takes its heads of all three)."""

    path: str
    column: bool
    parts: int = 1

    def matches(self, path: str) -> bool:
        return re.fullmatch(re.escape(self.path).replace(r"\*", r"\d+"), path) is not None


@dataclass(frozen=True)
class TensorPlan:
    """An architecture's parallelize plan: its blocks' place, their layers' cuts, the modules whose input
    the column-parallel layers in them share (entered once), the attributes counting a block's heads
    (divided by the group's size; none where the forward reads the heads from the weights' shapes),
    whether its weights are stored [in, out] (GPT-2's Conv1D) rather than torch's [out, in], and for
    sequence parallel where it starts and ends (the first block, whose input is cut into sequence slices,
    and the module after the blocks whose input is put back together; None: not supported. Slicing at the
    first block, not at the embeddings, leaves what a transformers model builds from the input's length
    before its layers, its causal mask and rotary tables, whole), the modules of a block whose input is
    gathered whole as it enters (they read its length), and those that run whole on every rank between
    the slices (``sequence_whole``: a mixture of experts, whose router and gates read every token; its
    input gathered, its output sliced again, its experts cut as without sequence parallel); and whether the
    model builds what its blocks read from its input's length before them (``length_before_blocks``: a
    transformers model's causal mask and rotary tables, which a later pipeline stage builds from the hidden
    states it receives, so under sequence parallel it gathers them whole first), and whether it views its
    blocks' output to its input's length after them (``views_after_blocks``: GPT-2's base model, which a
    pipeline stage's slice does not fit: a stage before the last gathers its output whole first)."""

    blocks_at: str
    cuts: tuple[Cut, ...]
    shared_inputs: tuple[str, ...] = ()
    heads_attrs: tuple[str, ...] = ()
    transposed: bool = False
    sequence_at: tuple[str, str] | None = None
    sequence_inputs: tuple[str, ...] = ()
    sequence_whole: tuple[str, ...] = ()
    length_before_blocks: bool = False
    views_after_blocks: bool = False

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return operator.attrgetter(self.blocks_at)(model)

    def cut_at(self, path: str) -> Cut | None:
        """The cut of the layer at ``path`` inside a block; None where the layer stays whole."""
        return next((c for c in self.cuts if c.matches(path)), None)

    def weight_split(self, cut: Cut) -> Split:
        """How ``cut``'s weight is split: along its output features (column) or its input features (row)."""
        out_dim = 1 if self.transposed else 0
        return Split(out_dim if cut.column else 1 - out_dim, cut.parts)

    def whole_in_block(self, name: str) -> bool:
        """Whether ``name`` is a block's parameter every rank of a group holds whole (a norm, a row-parallel
        layer's bias) outside the modules that run whole (``sequence_whole``): under sequence parallel each
        rank's gradient of it is its slice of the tokens' part."""
        inside = name.split(".", self.blocks_at.count(".") + 2)[-1]  # its path in its block
        return name.startswith(f"{self.blocks_at}.") and self.split_of(name) is None and not self.in_whole(inside)

    def in_whole(self, path: str) -> bool:
        """Whether ``path`` (inside a block) lies in a module that runs whole under sequence parallel."""
        return any(path == w or path.startswith(f"{w}.") for w in self.sequence_whole)

    def split_of(self, name: str) -> Split | None:
        m = re.match(rf"^{re.escape(self.blocks_at)}\.\d+\.(.+)\.(weight|bias)$", name)
        cut = self.cut_at(m.group(1)) if m else None
        if cut is None or (m.group(2) == "bias" and not cut.column):
            return None  # a row-parallel layer's bias is added once, after the sum: whole
        return self.weight_split(cut) if m.group(2) == "weight" else Split(0, cut.parts)


_MLP = (Cut("fc", True), Cut("proj", False))
GPT_PLAN = TensorPlan("blocks", (Cut("attn.qkv", True, 3), Cut("attn.proj", False),
                                 *(Cut(f"ffn.{c.path}", c.column) for c in _MLP),
                                 *(Cut(f"ffn.experts.*.{c.path}", c.column) for c in _MLP)),
                      heads_attrs=("attn.n_head",), sequence_at=("blocks.0", "ln_f"), sequence_inputs=("attn", "ffn"))
DECODER_PLAN = TensorPlan("model.layers", (
    Cut("self_attn.q_proj", True), Cut("self_attn.k_proj", True), Cut("self_attn.v_proj", True),
    Cut("self_attn.o_proj", False), Cut("mlp.gate_proj", True), Cut("mlp.up_proj", True),
    Cut("mlp.down_proj", False)), shared_inputs=("self_attn", "mlp"), sequence_at=("model.layers.0", "model.norm"),
    sequence_inputs=("self_attn", "mlp"), length_before_blocks=True)
GPT2_PLAN = TensorPlan("transformer.h", (Cut("attn.c_attn", True, 3), Cut("attn.c_proj", False),
                                         Cut("mlp.c_fc", True), Cut("mlp.c_proj", False)),
                       heads_attrs=("attn.split_size", "attn.num_heads"), transposed=True,
                       sequence_at=("transformer.h.0", "transformer.ln_f"), sequence_inputs=("attn", "mlp"),
                       length_before_blocks=True, views_after_blocks=True)
# GPT-NeoX fuses q, k and v head by head ([head][q k v] rows): a plain cut of the rows is whole heads
NEOX_PLAN = TensorPlan("gpt_neox.layers", (Cut("attention.query_key_value", True), Cut("attention.dense", False),
                                           Cut("mlp.dense_h_to_4h", True), Cut("mlp.dense_4h_to_h", False)),
                       sequence_at=("gpt_neox.layers.0", "gpt_neox.final_layer_norm"),
                       sequence_inputs=("attention", "mlp"), length_before_blocks=True)
# with experts: the router and gates read every token, so the mixture runs whole between the slices
GPT_MOE_PLAN = dataclasses.replace(GPT_PLAN, sequence_inputs=("attn",), sequence_whole=("ffn",))
PLANS = (GPT_PLAN, DECODER_PLAN, GPT2_PLAN, NEOX_PLAN)
HF_PLANS = {"llama": DECODER_PLAN, "qwen2": DECODER_PLAN, "mistral": DECODER_PLAN, "gpt2": GPT2_PLAN,
            "gpt_neox": NEOX_PLAN}
SUPPORTED = ("tiertrain's GPT (--model tiny/small/... or a config JSON, experts too) and transformers models "
             f"of {', '.join(HF_PLANS)}")


def split_of(name: str) -> Split | None:
    """How the parameter ``name`` (the whole model's name) is cut over a tensor-parallel group; None where
    every rank holds it whole."""
    return next((s for s in (p.split_of(name) for p in PLANS) if s is not None), None)


def check_tensor_parallel(model: nn.Module, tp: int) -> TensorPlan:
    """``model``'s plan; refused, in one line, where none can cut it into ``tp`` shards."""
    if isinstance(model, GPT):
        cfg = model.config
        _check_counts(tp, (cfg.dropout,), (("attention heads (n_head)", cfg.n_head), ("MLP features (d_ffn)", cfg.d_ffn)))
        return GPT_MOE_PLAN if cfg.is_moe else GPT_PLAN
    plan = _hf_plan(model)
    if plan is None:
        raise ConfigError(f"tensor parallel (--tp) has a parallelize plan for {SUPPORTED} only; got "
                          f"{type(model).__name__}: train it with data or pipeline parallel (--nproc, --pp) instead")
    cfg = model.config
    heads = cfg.num_attention_heads
    ffn = (cfg.n_inner or 4 * cfg.hidden_size) if plan is GPT2_PLAN else cfg.intermediate_size
    drops = ((cfg.attn_pdrop, cfg.resid_pdrop, cfg.embd_pdrop) if plan is GPT2_PLAN else
             (getattr(cfg, "attention_dropout", 0.0), getattr(cfg, "hidden_dropout", 0.0)))
    _check_counts(tp, drops, (
        ("attention heads (num_attention_heads)", heads),
        ("key-value heads (num_key_value_heads)", getattr(cfg, "num_key_value_heads", None) or heads),
        ("MLP features", ffn)))
    return plan


def check_pipeline_tensor(model: nn.Module, tp: int, pp: int) -> TensorPlan:
    """``check_tensor_parallel``, and where the blocks are also cut into ``pp`` stages, no head tied to the
    embedding (its two stages' pair of ranks is one per pipeline, not per group, yet)."""
    plan = check_tensor_parallel(model, tp)
    if pp > 1 and tp > 1 and tied_head(model):
        raise ConfigError("a tied embedding in a pipeline cut over tensor-parallel ranks is not supported yet: untie "
                          "the model's head (tie_embeddings: false, tie_word_embeddings: false)")
    return plan


def check_sequence_parallel(model: nn.Module, plan: TensorPlan) -> None:
    """Refuse, in one line, a model sequence parallel cannot slice: one whose plan says not where its
    sequence is cut and put together."""
    if plan.sequence_at is None:
        raise ConfigError(f"sequence parallel has no place to slice a {type(model).__name__}'s sequence yet: "
                          "leave --sequence-parallel out (tensor parallel alone cuts it)")


def _hf_plan(model: nn.Module) -> TensorPlan | None:
    """A transformers model's plan, where its type has one and its blocks are where the plan says."""
    plan = HF_PLANS.get(getattr(getattr(model, "config", None), "model_type", None))
    try:
        return plan if plan is not None and isinstance(plan.blocks(model), nn.ModuleList) else None
    except AttributeError:  # a base model without the causal LM's head around it: another layout
        return None


def _check_counts(tp: int, dropouts: tuple[float, ...], counts: tuple[tuple[str, int], ...]) -> None:
    if any(dropouts):
        raise ConfigError(f"tensor parallel needs dropout 0 (got {max(dropouts)}): the ranks of a group draw no "
                          "common dropout masks yet; set every dropout to 0 in the model's config")
    for what, n in counts:
        if n % tp:
            raise ConfigError(f"--tp {tp} must divide the model's {what}, {n}: choose a --tp that divides it")


def whole_in_a_block(model: nn.Module, plan: TensorPlan) -> int:
    """Elements of ``model``'s first block that every rank of a group holds whole as ``plan`` cuts it (norms,
    a row-parallel layer's bias, a router): what the planner keeps whole per rank (``planner.tensor``)."""
    block = plan.blocks(model)[0]
    return sum(p.numel() for name, p in block.named_parameters()
               if plan.split_of(f"{plan.blocks_at}.0.{name}") is None)


def cut_on_meta(model: nn.Module, plan: TensorPlan, tp: int) -> None:
    """``model`` (on the meta device) as one rank of a group of ``tp`` holds it: each parameter ``plan`` cuts
    in its shard's shape, what the planner counts a rank's blocks from (``runtime.blocks.block_sizes``)."""
    for name, p in list(model.named_parameters()):
        split = plan.split_of(name)
        if split is not None:
            shape = list(p.shape)
            shape[split.dim] //= tp
            module, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module), attr, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta")))


def summed_in_a_block(model: nn.Module, plan: TensorPlan) -> int:
    """Elements of ``model``'s first block whose gradients sequence parallel sums over a group
    (``TensorPlan.whole_in_block``: whole, outside a module run whole between the slices)."""
    block = plan.blocks(model)[0]
    return sum(p.numel() for name, p in block.named_parameters() if plan.whole_in_block(f"{plan.blocks_at}.0.{name}"))


def whole_per_block(cfg: ModelConfig) -> int:
    """``whole_in_a_block`` of our GPT of ``cfg`` (built on the meta device, one block)."""
    with torch.device("meta"):
        model = GPT(dataclasses.replace(cfg, n_layer=1))
    return whole_in_a_block(model, GPT_PLAN)
