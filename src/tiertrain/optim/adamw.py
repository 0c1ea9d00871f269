"""AdamW on one block's chunks with PyTorch's fused kernel.

We call the functional ``torch.optim.adamw.adamw(fused=True)`` on per-parameter views of
the block's master, grad and moment chunks: the very kernel ``torch.optim.AdamW(fused=True)``
runs, so an offloaded run matches plain PyTorch bit for bit (the kernel is elementwise,
so which tensors share a call does not change a bit). Parameters that got no gradient in
the accumulation window are skipped, as plain AdamW skips ``grad is None``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.optim.adamw import adamw

from tiertrain.memory.chunk import Chunk
from tiertrain.runtime.block_state import BlockState


def adamw_block(st: BlockState, groups: list[dict[str, Any]], clip_coef: torch.Tensor | None,
                grad: Chunk | None, has_grad: list[bool]) -> None:
    """One AdamW step of the block's master and moments with the gradients in ``grad``."""
    live = [i for i, h in enumerate(has_grad) if h]
    if not live or grad is None:
        return
    params, grads = st.views(st.master), st.views(grad)
    exp_avgs, exp_avg_sqs = st.views(st.exp_avg), st.views(st.exp_avg_sq)
    if grads[0].device != params[0].device:
        grads = [g.to(params[0].device) for g in grads]
    if clip_coef is not None:
        torch._foreach_mul_([grads[i] for i in live], clip_coef.to(grads[0].device))
    members: dict[int, list[int]] = defaultdict(list)
    for i in live:
        members[st.group_of[i]].append(i)
    for g, idx in members.items():
        grp = groups[g]
        adamw([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
              [exp_avg_sqs[i] for i in idx], [], [st.steps[i] for i in idx], fused=True, amsgrad=False,
              beta1=grp["betas"][0], beta2=grp["betas"][1], lr=grp["lr"], weight_decay=grp["weight_decay"],
              eps=grp["eps"], maximize=False)


def total_grad_norm(states_in_model_order: list[tuple[BlockState, int]], norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm as ``clip_grad_norm_`` computes it, over the host grad chunks."""
    views = {}
    grads = []
    for st, i in states_in_model_order:
        if st.has_grad[i]:
            if id(st) not in views:
                views[id(st)] = st.views(st.grad)
            grads.append(views[id(st)][i])
    if not grads:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(grads, norm_type)


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient, clamped to 1 (so clipping never scales up)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
