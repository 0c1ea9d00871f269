"""The module and autograd hooks that drive a step; each reads like the step it implements.

Forward: the block's group fetches its compute params (a streamed block takes a device slot,
waiting only if the copy has not landed, and triggers the next prefetches; a resident block waits
for its pending update), and disk reads of the states backward updates first are started.
Backward: a streamed block is fetched again before its backward, with its prefetches. Every
parameter's gradient leaves for its group's grad chunk as soon as it is accumulated; a block whose
gradients are all in is reduced at once, the rest when backward ends (parameters that got no
gradient, e.g. an idle expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiertrain.runtime.block_group import BlockGroup
from tiertrain.runtime.switches import HostStash, SavedTensors, wrap_forward

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime


def install_block_hooks(rt: "Runtime", g: BlockGroup) -> None:
    """The block's module hooks: they call the runtime with this group, whatever plan it runs under."""
    module = g.block.module
    module.register_forward_pre_hook(lambda m, a: rt.forward_begins(g))
    module.register_full_backward_pre_hook(lambda m, grad: rt.backward_begins(g))


def apply_switches(rt: "Runtime", g: BlockGroup) -> HostStash | None:
    """The block's activation switches as its plan says (recompute, offload_hidden; a streamed block's
    saved views of its params kept as places in its slot): its forward wrapped, over whatever wrapped it
    before (a new plan). The host stash, where it offloads."""
    module = g.block.module
    original = rt.own_forwards.get(g.index)  # what the module had before any plan wrapped it
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original
    stash = HostStash(rt.mem, g.block.name) if g.plan.offload_hidden else None
    if g.plan.recompute or g.plan.offload_hidden or g.plan.stream:
        hooks = SavedTensors(g, rt.mem, stash) if g.plan.offload_hidden or g.plan.stream else None
        module.forward = wrap_forward(module.forward, g.plan.recompute, hooks)
    return stash


def install_grad_hooks(rt: "Runtime", g: BlockGroup) -> None:
    for p in g.params:
        p.register_post_accumulate_grad_hook(lambda param, g=g: rt.grad_arrived(g))
