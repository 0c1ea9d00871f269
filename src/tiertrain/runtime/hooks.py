"""The module and autograd hooks that drive a step: each calls one block group's verb, as FSDP2's
``_pre_forward`` calls its param group's ``pre_forward``.

Forward: ``pre_forward`` fetches the block's compute params (a streamed block takes a device slot,
waiting only if the copy has not landed, and triggers the next prefetches; a resident block waits
for its pending update) and starts what its forward triggers for other blocks (disk reads, the next
resident block's gather); ``post_forward`` marks it done. Backward: ``pre_backward`` fetches a
streamed block again, with its prefetches, and starts its states' reads. Every parameter's gradient
is reported to its group as soon as it is accumulated; a group whose gradients are all in flushes
at once, the rest when backward ends (``runtime.backward``).
"""

from __future__ import annotations

from torch.utils.hooks import RemovableHandle

from tiertrain.errors import ConfigError
from tiertrain.memory import MemorySystem
from tiertrain.parallel.expert_layer import expert_layers
from tiertrain.runtime.block_group import BlockGroup
from tiertrain.runtime.streams import in_streams, streams_for
from tiertrain.runtime.switches import HostStash, SavedTensors, wrap_forward


def install_block_hooks(g: BlockGroup) -> list[RemovableHandle]:
    """The block's module hooks, calling the group; their handles (a new plan's groups replace them)."""
    module = g.block.module
    return [module.register_forward_pre_hook(lambda m, a: g.pre_forward()),
            module.register_forward_hook(lambda m, a, out: g.post_forward()),
            module.register_full_backward_pre_hook(lambda m, grad: g.pre_backward())]


def install_grad_hooks(g: BlockGroup) -> list[RemovableHandle]:
    return [p.register_post_accumulate_grad_hook(lambda param, i=i: g.grad_arrived(i)) for i, p in enumerate(g.params)]


def apply_switches(g: BlockGroup, mem: MemorySystem, own_forward: object) -> HostStash | None:
    """The block's activation switches as its plan says (recompute, offload_hidden; a streamed block's
    saved views of its params kept as places in its slot) and its streams: its forward wrapped, over
    whatever wrapped it before (a new plan). ``own_forward``: what the module had before any plan wrapped it. The host
    stash, where it offloads."""
    module = g.block.module
    if own_forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own_forward
    stash = HostStash(mem, g.block.name) if g.plan.offload_hidden else None
    if g.plan.recompute or g.plan.offload_hidden or g.plan.stream:
        hooks = SavedTensors(g, mem, stash) if g.plan.offload_hidden or g.plan.stream else None
        module.forward = wrap_forward(module.forward, g.plan.recompute, hooks)
    if g.plan.streams > 1:  # outermost: each chunk its own recompute and stash, as STRONGHOLD's executors
        if expert_layers(module):
            raise ConfigError(f"block {g.block.name} holds experts, whose routing and balance loss see the whole "
                              "batch: run it on one stream (\"streams\": 1 in the plan)")
        module.forward = in_streams(module.forward, g.plan.streams, streams_for(g.plan.streams, mem.device))
    return stash
