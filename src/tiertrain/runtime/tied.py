"""A tied weight's other uses (a GPT's head beside its token embedding) as leaves of their own.

Why: autograd sums every gradient of one leaf before that leaf's single accumulation runs. The
head's gradient of a tied embedding is computed first in backward, the embedding's last, so the
head's (vocab x d in fp32: 412 MB for GPT-2's vocabulary at d = 2048) waited outside every pool
for the whole backward. Here a module that registers the tied weight a second time sees, for the
length of its forward, a fresh leaf over the same storage; that leaf's gradient goes into the
block's grad chunk (inside the budgets) as soon as it exists. With two uses the chunk ends with
head + embedding, as autograd would have summed them (fp32 addition commutes), so the losses stay
bitwise plain PyTorch's in fp32 (``Runtime._tied_grads_early`` says where it applies). The group
then flushes when backward ends, never earlier: the leaf is not among the parameters it counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class TiedUse:
    """``module`` registers parameter ``index`` of a group's params as ``name``, and is not its first registration."""

    module: nn.Module
    name: str
    index: int


def extra_uses(model: nn.Module, params: list[nn.Parameter]) -> list[TiedUse]:
    """Every registration of one of ``params`` after its first, in ``model.modules()`` order."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    out = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or id(p) not in index:
                continue
            if id(p) in seen:
                out.append(TiedUse(module, name, index[id(p)]))
            seen.add(id(p))
    return out


def give_own_leaf(use: TiedUse, arrived: Callable[[int, torch.Tensor], None], enabled: Callable[[], bool]) -> None:
    """Wrap the module's forward so that, while ``enabled()`` and autograd records, it runs with a
    fresh leaf in place of the tied parameter; ``arrived(index, leaf)`` runs once the leaf's gradient
    is accumulated (``leaf.grad``). The parameter is back in place when the forward returns or raises."""
    module, forward = use.module, use.module.forward

    @functools.wraps(forward)
    def with_own_leaf(*args: object, **kwargs: object) -> object:
        param = module._parameters[use.name]
        if not (enabled() and torch.is_grad_enabled() and param.requires_grad):
            return forward(*args, **kwargs)
        leaf = param.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(lambda t: arrived(use.index, t))
        module._parameters[use.name] = leaf
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters[use.name] = param

    module.forward = with_own_leaf
