"""A transformers causal LM (Llama, Qwen2, Mistral, GPT-2, GPT-NeoX) cut into pipeline stages.

A stage runs the model's own base-model forward, with the base model's layers swapped for the stage's
for the length of the call, its final norm for an identity on all but the last stage, what the base model
adds to its first layer's input (GPT-2's position embeddings) for zeros after the first stage, and hidden
states passed in as ``inputs_embeds`` after the first: the causal mask, the positions and the rotary
embeddings are the family's own code, so a stage computes what the whole model computes, bit for bit.
Its parameters keep the model's names (``model.layers.5.mlp.up_proj.weight``, ``transformer.h.5.mlp.c_fc
.weight``). A tied head's weight spans the first and the last stage as ``models.stages`` says. Where each
family keeps those parts is data (``Parts``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError
from tiertrain.models.stages import PipelineStageModule, StageBlocks


@dataclass(frozen=True)
class Parts:
    """Where a family's causal LM keeps its decoder's parts: its base model, and in it the token embedding,
    the layers and the final norm; the head in the causal LM; ``whole``: base modules every stage keeps
    (buffers only: rotary frequencies); ``added``: base modules adding to the first layer's input, which
    the first stage holds and later stages replace by zeros."""

    base: str
    embed: str
    layers: str
    norm: str
    head: str = "lm_head"
    head_before: str = ""  # the head's name in transformers 4 where it differs (GPT-NeoX's ``embed_out``)
    whole: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    dropouts: tuple[str, ...] = ("attention_dropout",)  # config fields each stage would draw apart

    @property
    def tied_name(self) -> str:
        return f"{self.base}.{self.embed}.weight"


# the families whose base forward is embed (and GPT-2's positions), layers, norm and nothing else, and whose
# causal LM's forward is the head and nothing else (Granite scales its embeddings and logits, Cohere its
# logits: cut so, they would not be the model), checked against the plain model bit for bit
_LLAMA = Parts("model", "embed_tokens", "layers", "norm", whole=("rotary_emb",))
PARTS = {"llama": _LLAMA, "qwen2": _LLAMA, "mistral": _LLAMA,
         "gpt2": Parts("transformer", "wte", "h", "ln_f", added=("wpe",),
                       dropouts=("attn_pdrop", "resid_pdrop", "embd_pdrop")),
         "gpt_neox": Parts("gpt_neox", "embed_in", "layers", "final_layer_norm", head_before="embed_out",
                           whole=("rotary_emb",), dropouts=("attention_dropout", "hidden_dropout"))}
FAMILIES = tuple(PARTS)


def parts_of(model: nn.Module) -> Parts | None:
    """``model``'s parts where it is a transformers causal LM of one of ``FAMILIES`` laid out as they say."""
    parts = PARTS.get(getattr(getattr(model, "config", None), "model_type", None))
    if parts is not None and parts.head_before and not hasattr(model, parts.head):
        parts = dataclasses.replace(parts, head=parts.head_before)
    base = getattr(model, parts.base, None) if parts is not None else None
    if base is None or not isinstance(getattr(model, parts.head, None), nn.Module):
        return None
    named = (parts.embed, parts.layers, parts.norm, *parts.whole, *parts.added)
    if not all(isinstance(getattr(base, p, None), nn.Module) for p in named):
        return None
    return parts if isinstance(getattr(base, parts.layers), nn.ModuleList) else None


def check_decoder(model: nn.Module) -> None:
    """Refuse, in one line, what a stage of it could not compute as the whole model does."""
    cfg, parts = model.config, parts_of(model)
    if any(b.is_meta for b in model.buffers()):
        raise ConfigError(f"a {type(model).__name__} built on the meta device cannot be cut into stages yet (its "
                          "rotary embedding's frequencies are not drawn): build it in memory")
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if len(kinds) > 1:
        raise ConfigError(f"pipeline stages of a {type(model).__name__} whose layers differ in attention "
                          f"({', '.join(sorted(kinds))}) are not supported yet: each stage numbers its layers "
                          "from 0; give every layer one attention type")
    drops = {f: getattr(cfg, f, 0.0) for f in parts.dropouts if getattr(cfg, f, 0.0)}
    if drops:
        named = ", ".join(f"{f}={v}" for f, v in drops.items())
        raise ConfigError(f"pipeline parallel with dropout ({named}) is not supported yet: each stage would draw its "
                          "masks from its own generator; set them to 0 in the model's config")


class _Zeros(nn.Module):
    """In place of a module adding to the first layer's input (GPT-2's position embedding) on a later
    stage: zeros of the hidden states' width and the stage's dtype, so the input passes unchanged."""

    def __init__(self, width: int, like: nn.Module) -> None:
        super().__init__()
        self.width = width
        object.__setattr__(self, "_like", like)  # not registered: only its dtype is read

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = next(self._like.parameters())
        return torch.zeros(*ids.shape, self.width, dtype=p.dtype, device=ids.device)


class DecoderStage(PipelineStageModule):
    """A run of a transformers causal LM's layers (``embeds``: with the token embedding before them, token
    ids in; ``heads``: with the final norm and the head after them, logits out)."""

    def __init__(self, model: nn.Module, blocks: range, embeds: bool, heads: bool, ties: bool) -> None:
        super().__init__(model.config, embeds, heads, ties)
        parts = self.parts = parts_of(model)
        base = getattr(model, parts.base)
        object.__setattr__(self, "_base", base)  # not registered: the stage holds only its own parts
        self.tied_name = parts.tied_name
        mine = nn.Module()
        setattr(self, parts.base, mine)
        if embeds:
            for name in (parts.embed, *parts.added):
                setattr(mine, name, getattr(base, name))
        setattr(mine, parts.layers, StageBlocks(getattr(base, parts.layers), blocks))
        for name in parts.whole:  # buffers only (rotary frequencies)
            setattr(mine, name, getattr(base, name))
        if heads:
            setattr(mine, parts.norm, getattr(base, parts.norm))
            head = getattr(model, parts.head)
            if self.tied_across:
                setattr(mine, parts.embed, self._tied_copy(getattr(base, parts.embed).weight, head))
            setattr(self, parts.head, head)
        self.handoff = nn.Identity()  # in the final norm's place before the last stage: hidden states handed on
        layers = getattr(mine, parts.layers)  # a later stage's stand-ins for what the base adds to the input
        object.__setattr__(self, "_zeros", {} if embeds else {n: _Zeros(self.hidden_size, layers) for n in parts.added})

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts, base, mine = self.parts, self._base, getattr(self, self.parts.base)
        layers = getattr(mine, parts.layers)
        swapped = {parts.layers: layers, parts.norm: getattr(mine, parts.norm) if self.heads else self.handoff}
        swapped.update(self._zeros)
        kept = {name: getattr(base, name) for name in swapped}
        for name, module in swapped.items():
            setattr(base, name, module)
        try:
            flags = dict(use_cache=False, return_dict=True, output_hidden_states=False, output_attentions=False)
            out = base(input_ids=x, **flags) if self.embeds else base(inputs_embeds=x, **flags)
        finally:
            for name, module in kept.items():
                setattr(base, name, module)
        hidden = out.last_hidden_state
        return getattr(self, parts.head)(hidden) if self.heads else hidden
