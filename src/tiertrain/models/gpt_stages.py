"""Our GPT cut into pipeline stages (``models.stages``): each stage a run of the model's blocks, the first
with the embeddings before it, the last with the final norm and the head after it. The stage's ops are the
model's ops in the model's order, so a pipelined run computes what one process computes, bit for bit.
"""

from __future__ import annotations

import torch

from tiertrain.errors import ConfigError
from tiertrain.models.gpt import GPT
from tiertrain.models.stages import TIED_GPT, PipelineStageModule, StageBlocks


class GPTStage(PipelineStageModule):
    tied_name = TIED_GPT

    def __init__(self, model: GPT, blocks: range, embeds: bool, heads: bool, ties: bool) -> None:
        super().__init__(model.config, embeds, heads, ties)
        if embeds:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = StageBlocks(model.blocks, blocks)
        if heads:
            self.ln_f = model.ln_f
            if self.tied_across:  # before the head: the copy's name is the model's
                self.tok_emb = self._tied_copy(model.tok_emb.weight, model.lm_head)
            self.lm_head = model.lm_head

    @property
    def hidden_size(self) -> int:
        return self.config.d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeds:  # GPT.forward's first lines
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.heads else x


def check_gpt(model: GPT) -> None:
    """What a stage of our GPT cannot compute as the whole model does, refused in one line with the fix."""
    if model.config.is_moe:
        raise ConfigError("pipeline parallel with mixture-of-experts blocks is not supported yet: train the MoE model "
                          "with data and expert parallel (--nproc N --ep E)")
    if model.config.dropout:
        raise ConfigError(f"pipeline parallel with dropout ({model.config.dropout}) is not supported yet: each stage "
                          "would draw its masks from its own generator; build the model with dropout=0")


def stage_of(model: GPT, blocks: range) -> GPTStage:
    """The stage holding ``blocks`` of ``model`` (the embeddings with block 0, the head with the last)."""
    return GPTStage(model, blocks, blocks.start == 0, blocks.stop == len(model.blocks),
                    model.lm_head.weight is model.tok_emb.weight)
