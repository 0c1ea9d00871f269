"""Our GPT cut into pipeline stages: each stage a run of the model's blocks, the first with the
embeddings before it, the last with the final norm and the head after it.

Built by hand, as the pipelining issue asks: torch's tracing front end (``pipeline()`` over an exported
graph) breaks on real models, and a stage here is the model's own modules, so its parameters, their
names (``blocks.3.attn.qkv.weight`` keeps the model's index) and its forward are the model's. The
stage's ops are the model's ops in the model's order, so a pipelined run computes what one process
computes, bit for bit.

A tied embedding (the head using ``tok_emb``'s weight) spans the first and the last stage, on two ranks:
as Megatron does, the last stage holds a copy of the weight (``TiedCopy``, registered as ``tok_emb.weight``
and used by its head, so its checkpoint entries keep the model's name), the two stages' gradients of it are
summed before every step (``parallel.tied_stages``), and both update it alike.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError
from tiertrain.models.gpt import GPT


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


TIED = "tok_emb.weight"  # a tied model's embedding weight, which its head uses too


class TiedCopy(nn.Module):
    """The last stage's copy of a tied embedding weight, under the embedding's name (never called: the head
    uses it)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class GPTStage(nn.Module):
    """A run of a GPT's blocks; ``embeds``: the model's input side before them (token ids in),
    ``heads``: its output side after them (logits out). Hidden states in and out otherwise.
    ``copy_of``: a tied weight's copy here (the last stage's) -> the model's own parameter."""

    def __init__(self, model: GPT, blocks: range, embeds: bool, heads: bool) -> None:
        super().__init__()
        self.config, self.embeds, self.heads = model.config, embeds, heads
        self.first_block = blocks.start
        self.copy_of: dict[nn.Parameter, nn.Parameter] = {}
        if embeds:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = StageBlocks(model.blocks, blocks)
        if heads:
            self.ln_f = model.ln_f
            if model.config.tie_embeddings and not embeds:  # before the head: the copy's name is the model's
                self.tok_emb = self._tied_copy(model)
            self.lm_head = model.lm_head

    def _tied_copy(self, model: GPT) -> TiedCopy:
        """The last stage's copy of the tied weight, which this rank's head (the model's module) uses from now on."""
        original = model.tok_emb.weight
        copy = nn.Parameter(original.detach().clone(), original.requires_grad)
        model.lm_head.weight = copy
        self.copy_of[copy] = original
        return TiedCopy(copy)

    @property
    def tied(self) -> bool:
        """Whether it holds one side of a tied weight split over the first and the last stage."""
        return self.config.tie_embeddings and self.embeds != self.heads and (self.embeds or self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeds:  # GPT.forward's first lines
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.heads else x


def check_stageable(model: nn.Module) -> GPT:
    """``model`` as a GPT a pipeline can cut, or one message naming why not and the fix."""
    if not isinstance(model, GPT):
        raise ConfigError(f"pipeline parallel cuts tiertrain's GPT into stages; a {type(model).__name__} has no "
                          "stages yet: train it with data parallel (--nproc N without --pp)")
    if model.config.is_moe:
        raise ConfigError("pipeline parallel with mixture-of-experts blocks is not supported yet: train the MoE model "
                          "with data and expert parallel (--nproc N --ep E)")
    if model.config.dropout:
        raise ConfigError(f"pipeline parallel with dropout ({model.config.dropout}) is not supported yet: each stage "
                          "would draw its masks from its own generator; build the model with dropout=0")
    return model


def stage_of(model: GPT, blocks: range) -> GPTStage:
    """The stage holding ``blocks`` of ``model`` (the embeddings with block 0, the head with the last)."""
    return GPTStage(model, blocks, embeds=blocks.start == 0, heads=blocks.stop == len(model.blocks))


def release_others(model: GPT, stages: list[GPTStage]) -> None:
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
