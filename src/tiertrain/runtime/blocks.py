"""Finding the blocks of a model: the units the runtime schedules.

The repeated blocks are the ``nn.ModuleList`` of structurally equal modules (same
parameter names, shapes and dtypes) that covers the most parameters, then the longest:
our GPT's ``blocks``, a transformers model's ``layers``/``h``. (Plain "longest" would pick
an MoE layer's experts when there are more experts than layers.) Everything else (embeddings, head, final norm) forms the
"rest" block. A user can name the list instead (``blocks="model.layers"``).

With expert parallel a block's parameters are grouped by parallel pattern (``split_experts``): its
mixture-of-experts layers' experts apart from the rest, since each rank holds only some of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from tiertrain.errors import ConfigError
from tiertrain.memory.layout import ChunkLayout
from tiertrain.plan.fit import Sizes
from tiertrain.parallel.expert_layer import ExpertLayer, expert_layers, expert_params


@dataclass
class Block:
    name: str
    module: nn.Module | None          # None for the rest block (no single module call)
    params: list[tuple[str, nn.Parameter]]  # (fully qualified name, parameter), in model order


def block_layout(block: Block, shard_count: int = 1) -> ChunkLayout:
    """Where each of the block's parameters sits in its chunks (every state kind shares it), padded to
    split into ``shard_count`` equal shards."""
    return ChunkLayout.build([(n, tuple(p.shape)) for n, p in block.params], shard_count=shard_count)


def block_numel(block: Block) -> int:
    """Elements in each of the block's chunks, padding included."""
    return block_layout(block).numel


def block_sizes(blocks: list[Block], ep: int = 1) -> Sizes:
    """What the blocks hold, as ``plan.fit`` counts it: each block's elements and, under expert parallel
    (``ep`` > 1), each block's without its experts and the experts one rank holds (every rank holds as
    many, of one size) apart."""
    if ep == 1:
        return Sizes(tuple(block_numel(b) for b in blocks))
    split, held = split_experts(blocks, lambda m: range(m.n_experts // ep))
    return Sizes(tuple(block_numel(b) for b in split),
                 tuple(block_numel(held[i].block) if i in held else 0 for i in range(len(blocks))))


def _signature(m: nn.Module) -> tuple:
    return tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())


def find_block_list(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(f"the model has no submodule {path!r}; name its list of layers") from None
        if not isinstance(found, nn.ModuleList):
            raise ConfigError(f"{path!r} is a {type(found).__name__}, not an nn.ModuleList of layers")
        return path, found
    best: tuple[str, nn.ModuleList] | None = None
    best_key = (0, 0)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            sig = _signature(mod[0])
            if sig and all(_signature(m) == sig for m in mod):
                key = (sum(p.numel() for p in mod.parameters()), len(mod))
                if key > best_key:
                    best, best_key = (name, mod), key
    if best is None:
        raise ConfigError("found no nn.ModuleList of identical layers in this model; pass blocks='path.to.layers'")
    return best


def find_blocks(model: nn.Module, path: str | None = None) -> list[Block]:
    """The repeated blocks in order, then the rest block last."""
    list_name, layers = find_block_list(model, path)
    owner = {}
    # named by the list's own keys: a pipeline stage's list keeps the model's indices (``models.gpt_stages``)
    blocks = [Block(f"{list_name}.{key}", layer, []) for key, layer in layers._modules.items()]
    for i, block in enumerate(blocks):
        for p in block.module.parameters():
            owner[id(p)] = i
    rest = Block("rest", None, [])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (blocks[owner[id(p)]] if id(p) in owner else rest).params.append((name, p))
    return blocks + [rest]


@dataclass
class HeldExperts:
    """One block's experts under expert parallel: those this rank holds (a block of their own, with no
    module of its own: its block's hooks fetch it) and every rank's (in model order, whose values at
    rank 0 are every rank's initial weights)."""

    block: Block
    every: list[tuple[str, nn.Parameter]]


def split_experts(blocks: list[Block], owned: Callable[[ExpertLayer], range]) -> tuple[list[Block], dict[int, HeldExperts]]:
    """The blocks without their experts' parameters, and per block with mixture-of-experts layers (by
    index) the experts this rank holds (``owned`` of each layer)."""
    out, held = [], {}
    for i, b in enumerate(blocks):
        layers = expert_layers(b.module) if b.module is not None else []
        if not layers:
            out.append(b)
            continue
        expert = {id(p) for m in layers for p in expert_params(m)}
        mine = {id(p) for m in layers for p in expert_params(m, owned(m))}
        every = [(n, p) for n, p in b.params if id(p) in expert]
        out.append(Block(b.name, b.module, [(n, p) for n, p in b.params if id(p) not in expert]))
        held[i] = HeldExperts(Block(f"{b.name}.experts", None, [(n, p) for n, p in every if id(p) in mine]), every)
    return out, held
