"""A transformers decoder (Llama, Qwen2, Mistral and the families built alike: ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) cut into pipeline stages.

A stage runs the model's own base-model forward, with the base model's layers swapped for the stage's
for the length of the call, its norm for an identity on all but the last stage, and hidden states passed
in as ``inputs_embeds`` after the first: the causal mask, the positions and the rotary embeddings are
the family's own code, so a stage computes what the whole model computes, bit for bit. Its parameters
keep the model's names (``model.layers.5.mlp.up_proj.weight``). A tied head's weight spans the first and
the last stage as ``models.stages`` says.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError
from tiertrain.models.stages import TIED_HF, PipelineStageModule, StageBlocks

PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
# the families whose base forward is embed, layers, norm and nothing else, and whose causal LM's forward is the
# head and nothing else (Granite scales its embeddings and logits, Cohere its logits: cut so, they would not be
# the model), checked against the plain model bit for bit
FAMILIES = ("llama", "qwen2", "mistral")


def is_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal LM of one of ``FAMILIES``."""
    base = getattr(model, "model", None)
    return (getattr(getattr(model, "config", None), "model_type", None) in FAMILIES and base is not None
            and isinstance(getattr(model, "lm_head", None), nn.Module)
            and all(isinstance(getattr(base, p, None), nn.Module) for p in PARTS)
            and isinstance(base.layers, nn.ModuleList))


def check_decoder(model: nn.Module) -> None:
    """Refuse, in one line, what a stage of it could not compute as the whole model does."""
    cfg = model.config
    if any(b.is_meta for b in model.buffers()):
        raise ConfigError(f"a {type(model).__name__} built on the meta device cannot be cut into stages yet (its "
                          "rotary embedding's frequencies are not drawn): build it in memory")
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if len(kinds) > 1:
        raise ConfigError(f"pipeline stages of a {type(model).__name__} whose layers differ in attention "
                          f"({', '.join(sorted(kinds))}) are not supported yet: each stage numbers its layers "
                          "from 0; give every layer one attention type")
    if getattr(cfg, "attention_dropout", 0.0):
        raise ConfigError(f"pipeline parallel with attention dropout ({cfg.attention_dropout}) is not supported yet: "
                          "each stage would draw its masks from its own generator; set attention_dropout=0")


class DecoderStage(PipelineStageModule):
    """A run of a transformers decoder's layers (``embeds``: with the token embedding before them, token ids
    in; ``heads``: with the final norm and the head after them, logits out)."""

    def __init__(self, model: nn.Module, blocks: range, embeds: bool, heads: bool, ties: bool) -> None:
        super().__init__(model.config, embeds, heads, ties)
        base = model.model
        object.__setattr__(self, "_base", base)  # not registered: the stage holds only its own parts
        self.model = nn.Module()
        if embeds:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = StageBlocks(base.layers, blocks)
        self.model.rotary_emb = base.rotary_emb  # buffers only (its inverse frequencies)
        if heads:
            self.model.norm = base.norm
            if self.tied_across:
                self.model.embed_tokens = self._tied_copy(base.embed_tokens.weight, model.lm_head)
            self.lm_head = model.lm_head

    tied_name = TIED_HF

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, mine = self._base, self.model
        kept = base.layers, base.norm
        base.layers, base.norm = mine.layers, (mine.norm if self.heads else nn.Identity())
        try:
            flags = dict(use_cache=False, return_dict=True, output_hidden_states=False, output_attentions=False)
            out = base(input_ids=x, **flags) if self.embeds else base(inputs_embeds=x, **flags)
        finally:
            base.layers, base.norm = kept
        return self.lm_head(out.last_hidden_state) if self.heads else out.last_hidden_state

