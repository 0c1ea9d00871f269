"""Every rank of a tensor-parallel group starts from one whole model before it is cut.

Ranks seeded otherwise would each cut their shards out of their own draw of a matrix, and keep norms,
embeddings and head of their own (the group never exchanges them: their gradients are the same on every
rank, so they stay as they started). A model built in memory takes the group's first rank's weights.
One built on the meta device (larger than a host's memory) is drawn here instead of by setup: setup draws
each rank's meta shards from its own generator in one order, which hands every rank of a group the same
numbers for different heads (a model as if 1/T as wide, never broken apart without dropout). So each
matrix the plan cuts is drawn whole from a generator seeded by the group's seed and the parameter's name,
one block at a time just before its cut (``parallel.tensor_parallelize``), a block's whole ones (norms, a
router) with it, and the rest (embeddings, head) here.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from tiertrain.models.init import init_in_place
from tiertrain.parallel.collectives import Collectives


def group_seed(group: Collectives) -> int:
    """A seed every rank of ``group`` holds alike: its first rank's."""
    seed = torch.randint(0, 1 << 62, (1,))
    group.host.broadcast(seed, src=0)
    return int(seed.item())


def drawn_whole(name: str, p: nn.Parameter, seed: int) -> None:
    """``p`` (on the meta device) materialised as the whole model's ``name`` would be drawn, from a generator
    of its own seeded by ``seed`` and the name (torch's generators untouched): the same numbers on every
    rank of the group. A cut layer's are let go again once cut (``back_to_meta``)."""
    value = torch.empty(p.shape, dtype=p.dtype)
    g = torch.Generator().manual_seed((seed + zlib.crc32(name.encode())) % (1 << 63))
    init_in_place(name, value, g)
    torch.utils.swap_tensors(p, nn.Parameter(value, p.requires_grad))


def back_to_meta(p: nn.Parameter) -> None:
    """A whole parameter drawn for its cut, on the meta device again: the optimizer built over the whole
    model still refers to it until it is pointed at the shards, and must not keep every block's matrices."""
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))


def same_start(model: nn.Module, group: Collectives, seed: int, blocks_at: str) -> None:
    """The group's first rank's weights on every rank, where the model was built in memory; the meta ones
    outside its blocks (named ``blocks_at.N...``) drawn alike (the blocks' are drawn as they are cut)."""
    for name, p in model.named_parameters():
        if not p.is_meta:
            group.host.broadcast(p.data, src=0)
        elif not name.startswith(f"{blocks_at}."):
            drawn_whole(name, p, seed)
