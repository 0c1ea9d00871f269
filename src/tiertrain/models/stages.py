"""A model cut into pipeline stages: what every kind of stage shares (the model's blocks under their own
indices, a tied weight's copy, the names the stage keeps) and which models can be cut (``check_stageable``:
tiertrain's GPT, ``models.gpt_stages``; transformers causal LMs, ``models.hf_stages``).

Stages are built by hand, as the pipelining issue asks: torch's tracing front end (``pipeline()`` over an
exported graph) breaks on real models, and a stage here is the model's own modules, so its parameters,
their names and its forward are the model's.

A tied embedding (the head using the input embedding's weight) spans the first and the last stage, on two
ranks: as Megatron does, the last stage holds a copy of the weight (``TiedCopy``, registered under the
embedding's name and used by its head, so its checkpoint entries keep the model's name), the two stages'
gradients of it are summed before every step (``parallel.tied_stages``), and both update it alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError

TIED_GPT = "tok_emb.weight"  # the embedding weight a tied head uses (transformers': ``hf_stages.Parts.tied_name``)
# the tied weights the first and the last stage may both hold (tests/test_pipeline_run.py checks the families')
TIED_NAMES = frozenset({TIED_GPT, "model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight"})


class StageBlocks(nn.ModuleList):
    """A run of a model's blocks under the model's own indices (``blocks.7.attn.qkv.weight`` in a stage
    holding blocks 6 and 7, as in the model), so a stage's parameter names, state dict and checkpoint
    entries are the whole model's; indexed by position like any list."""

    def __init__(self, blocks: nn.ModuleList, run: range) -> None:
        super().__init__()
        for i in run:
            self._modules[str(i)] = blocks[i]

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:  # type: ignore[override]
        return list(self._modules.values())[idx]

    def _fixed(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a pipeline stage's blocks are the model's, under its indices: they are not changed in place")

    append = extend = insert = __setitem__ = __delitem__ = _fixed  # type: ignore[assignment]


class TiedCopy(nn.Module):
    """The last stage's copy of a tied embedding weight, under the embedding's name (never called: the head
    uses it)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class PipelineStageModule(nn.Module):
    """A run of a model's blocks; ``embeds``: with the model's input side before them (token ids in),
    ``heads``: with its output side after them (logits out); hidden states in and out otherwise.
    ``copy_of``: a tied weight's copy here (the last stage's) -> the model's own parameter."""

    tied_name = ""  # the name of the weight the head shares with the input embedding, where it ties
    balance_scale: torch.Tensor | None = None  # where blocks add losses of their own: their weight (weigh_balance)

    def __init__(self, config: object, embeds: bool, heads: bool, ties: bool) -> None:
        super().__init__()
        self.config, self.embeds, self.heads = config, embeds, heads
        self.ties = ties  # the model's head uses its input embedding's weight (as registered, not as configured)
        self.copy_of: dict[nn.Parameter, nn.Parameter] = {}

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    def weigh_balance(self, micro_batches: int, device: torch.device) -> None:
        """Where the model adds its blocks' own losses to its loss (a mixture of experts' load balancing),
        their weight in a micro-batch's loss of ``micro_batches`` (on the compute ``device``); nothing to
        weigh otherwise."""

    @property
    def tied(self) -> bool:
        """Whether it holds one side of a tied weight split over the first and the last stage."""
        return self.ties and self.embeds != self.heads

    @property
    def tied_across(self) -> bool:
        """Whether it is the last stage of a tied model, without the first's embedding: it holds a copy."""
        return self.ties and self.heads and not self.embeds

    def _tied_copy(self, original: nn.Parameter, head: nn.Module) -> TiedCopy:
        """The last stage's copy of the tied weight, which this rank's head (the model's module) uses from now on."""
        copy = nn.Parameter(original.detach().clone(), original.requires_grad)
        head.weight = copy
        self.copy_of[copy] = original
        return TiedCopy(copy)


@dataclass(frozen=True)
class StageCut:
    """How a model is cut: its blocks' count, its tied weight (if its head ties), and a stage of a run of blocks."""

    model: nn.Module
    n_blocks: int
    ties: bool
    embedding: nn.Module                       # the module whose ``weight`` a tied head uses
    make: Callable[[nn.Module, range, bool, bool, bool], PipelineStageModule]

    def stage(self, blocks: range) -> PipelineStageModule:
        """The stage holding ``blocks`` (the input side with block 0, the output side with the last)."""
        return self.make(self.model, blocks, blocks.start == 0, blocks.stop == self.n_blocks, self.ties)


def tied_head(model: nn.Module) -> bool:
    """Whether ``model``'s head is its token embedding's weight (our GPT's, or a transformers model's): read
    on a model built on the meta device too, before any stage is cut."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok_emb
    return head is not None and head.weight is embedding.weight


def check_stageable(model: nn.Module) -> StageCut:
    """How ``model`` is cut into stages, or one message naming why it cannot be and the fix."""
    from tiertrain.models import hf_stages
    from tiertrain.models.gpt import GPT
    from tiertrain.models.gpt_stages import GPTStage, check_gpt

    if isinstance(model, GPT):
        check_gpt(model)
        return StageCut(model, len(model.blocks), model.lm_head.weight is model.tok_emb.weight, model.tok_emb,
                        GPTStage)
    parts = hf_stages.parts_of(model)
    if parts is not None:
        hf_stages.check_decoder(model)
        base = getattr(model, parts.base)
        embedding = getattr(base, parts.embed)
        return StageCut(model, len(getattr(base, parts.layers)), getattr(model, parts.head).weight is embedding.weight,
                        embedding, hf_stages.DecoderStage)
    raise ConfigError(f"pipeline parallel cuts tiertrain's GPT and transformers {', '.join(hf_stages.FAMILIES)} "
                      f"models; a {type(model).__name__} has no stages yet: train it with data parallel (--nproc N "
                      "without --pp)")


def release_others(model: nn.Module, stages: list[nn.Module]) -> None:
    """Put every parameter of ``model`` no stage of this rank holds on the meta device, in place (the same
    parameter objects, whoever else holds them): other ranks hold and train those, and their weights would
    otherwise stay in this rank's memory for the whole run. ``Module.to("meta")`` would make new objects
    and leave the old ones, and their memory, to anyone still holding them."""
    kept = {id(p) for s in stages for p in s.parameters()}
    for name, p in model.named_parameters():
        if id(p) not in kept and not p.is_meta:
            try:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
            except RuntimeError as exc:  # a weak reference to it, or a graph that saved it
                raise ConfigError(f"cannot release {name}, which another rank's stage holds: {exc}; pass the model "
                                  "before compiling it or running it") from None
    _unregister_outside(model, stages, kept)


def _unregister_outside(model: nn.Module, stages: list[nn.Module], kept: set[int]) -> None:
    """A module no stage of this rank holds that registers a parameter one does (the head of a tied model on
    the first stage's rank) gets a meta stand-in: setup installs its own tensors in the stage's modules only,
    and the old registration would keep the original's memory for the whole run."""
    inside = {id(m) for s in stages for m in s.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in kept:
                module._parameters[key] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
