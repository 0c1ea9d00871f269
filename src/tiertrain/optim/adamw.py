"""AdamW on flat views of chunks, with PyTorch's fused kernel: arithmetic over tensors only.

We call the functional ``torch.optim.adamw.adamw(fused=True)`` on per-parameter views of a
block's master, gradient and moment chunks: the very kernel ``torch.optim.AdamW(fused=True)``
runs, so an offloaded run matches plain PyTorch bit for bit (the kernel is elementwise, so
which tensors share a call does not change a bit). Parameters that got no gradient are
skipped, as plain AdamW skips ``grad is None``. Where the tensors live and how they got there
is the runtime's business, not this module's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch.optim.adamw import adamw

from tiertrain.optim.hparams import AdamWHyper


def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], live: Sequence[bool],
               group_of: Sequence[int], hypers: Sequence[AdamWHyper], grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step of every parameter ``i`` with ``live[i]``, by its group's ``hypers[group_of[i]]``;
    the gradients are first multiplied by ``grad_scale`` (the clip coefficient, 1/loss scale)."""
    idx = [i for i, on in enumerate(live) if on]
    if not idx:
        return
    if grads[0].device != params[0].device:
        grads = [g.to(params[0].device) for g in grads]
    if grad_scale is not None:
        torch._foreach_mul_([grads[i] for i in idx], grad_scale.to(grads[0].device))
    members: dict[int, list[int]] = defaultdict(list)
    for i in idx:
        members[group_of[i]].append(i)
    for g, ids in members.items():
        h = hypers[g]
        adamw([params[i] for i in ids], [grads[i] for i in ids], [exp_avgs[i] for i in ids],
              [exp_avg_sqs[i] for i in ids], [], [steps[i] for i in ids], fused=True, amsgrad=False,
              beta1=h.betas[0], beta2=h.betas[1], lr=h.lr, weight_decay=h.weight_decay, eps=h.eps, maximize=False)
