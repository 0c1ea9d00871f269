"""Our GPT cut into pipeline stages (``models.stages``): each stage a run of the model's blocks, the first
with the embeddings before it, the last with the final norm and the head after it. The stage's ops are the
model's ops in the model's order, so a pipelined run computes what one process computes, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from tiertrain.errors import ConfigError
from tiertrain.models.gpt import GPT
from tiertrain.models.stages import TIED_GPT, PipelineStageModule, StageBlocks


class _WithBalance(torch.autograd.Function):
    """``x`` as it is; backward also hands a block's load-balancing loss ``aux`` the gradient the whole model's
    loss gives it (``scale``): the model adds each block's to its loss, which a stage before the last does not
    see, so the stage adds it where the block's output leaves (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale, None


class GPTStage(PipelineStageModule):
    tied_name = TIED_GPT

    def __init__(self, model: GPT, blocks: range, embeds: bool, heads: bool, ties: bool) -> None:
        super().__init__(model.config, embeds, heads, ties)
        if embeds:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = StageBlocks(model.blocks, blocks)
        self.block_indices = blocks
        self.balance_scale: torch.Tensor | None = None  # with experts: d(a micro-batch's loss)/d(a block's balance loss)
        self.balance_seen: list[torch.Tensor] = []  # each forward's blocks' balance losses, detached (for the loss)
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
        balance = []
        for block in self.blocks:
            x = block(x)
            if self.balance_scale is not None:
                balance.append(block.ffn.last_aux_loss)
                x = _WithBalance.apply(x, balance[-1], self.balance_scale)
        if balance:
            self.balance_seen.append(torch.stack(balance).detach())  # (to the host once the step is over)
        return self.lm_head(self.ln_f(x)) if self.heads else x

    def weigh_balance(self, micro_batches: int, device: torch.device) -> None:
        """With experts: each block's load-balancing loss weighed as the whole model's loss weighs it, a
        micro-batch's loss divided by ``micro_batches``: ((1 / M) x coef) / blocks, as autograd computes it
        through ``GPT.forward``'s ``loss + coef * mean`` divided by M (bit for bit); on the compute ``device``,
        where backward hands it on without a copy."""
        if self.config.is_moe:
            one = torch.ones((), device=device)
            self.balance_scale = one / micro_batches * self.config.aux_loss_coef / self.config.n_layer


def check_gpt(model: GPT) -> None:
    """What a stage of our GPT cannot compute as the whole model does, refused in one line with the fix."""
    if model.config.dropout:
        raise ConfigError(f"pipeline parallel with dropout ({model.config.dropout}) is not supported yet: each stage "
                          "would draw its masks from its own generator; build the model with dropout=0")


def stage_of(model: GPT, blocks: range) -> GPTStage:
    """The stage holding ``blocks`` of ``model`` (the embeddings with block 0, the head with the last)."""
    return GPTStage(model, blocks, blocks.start == 0, blocks.stop == len(model.blocks),
                    model.lm_head.weight is model.tok_emb.weight)
