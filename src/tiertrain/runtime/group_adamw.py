"""AdamW on one block group's states, where they are in memory: the fused kernel over its parameters'
views (or, sharded, this rank's pieces of them), and the step counts beside the master's device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiertrain.optim import AdamWHyper, adamw_step
from tiertrain.runtime.grads import TakenGrads

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup

F32 = torch.float32


def adamw_block(group: "BlockGroup", hypers: list[AdamWHyper], coef: torch.Tensor | None, taken: TakenGrads) -> None:
    """One AdamW step of the block's master and moments (this rank's pieces) with the gradients it took."""
    owners = group.view_params
    views = group.views if group.shard is None else group.state_views
    masters = views(group.master)
    if masters:  # a shard may hold no piece of this block
        group.steps_on(masters[0].device)
    adamw_step(masters, views(taken.chunk), views(group.exp_avg), views(group.exp_avg_sq),
               [group.steps[i] for i in owners], [taken.has_grad[i] for i in owners],
               [group.group_of[i] for i in owners], hypers, coef)
