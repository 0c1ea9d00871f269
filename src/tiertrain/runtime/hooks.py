"""The module and autograd hooks that drive a step; each reads like the step it implements.

Forward: a streamed block acquires a device slot (waiting only if the copy has not landed)
and triggers the next prefetches; a resident block waits for its pending update; either
triggers the reads of the states backward updates first, once their disk is free.
Backward: a streamed block is acquired again before its backward, with its prefetches.
Every parameter's gradient leaves for its block's grad chunk (on the host, or on the device
for a device-homed block) as soon as it is accumulated; a block whose gradients are all in
is flushed at once, the rest when backward ends (parameters that got no gradient, e.g. an
idle expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from tiertrain.memory import Kind, MemorySystem, Tier
from tiertrain.plan_bytes import grad_tier
from tiertrain.runtime.block_state import BlockState
from tiertrain.runtime.switches import HostStash, SavedTensors, wrap_forward

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime


def install_block_hooks(rt: "Runtime", st: BlockState) -> None:
    module = st.block.module
    module.register_forward_pre_hook(lambda m, a: rt.forward_begins(st))
    module.register_full_backward_pre_hook(lambda m, g: rt.backward_begins(st))
    if st.plan.recompute or st.plan.offload_hidden or st.plan.stream:
        st.stash = HostStash(rt.mem, st.block.name) if st.plan.offload_hidden else None
        hooks = SavedTensors(st, rt.mem, st.stash) if st.plan.offload_hidden or st.plan.stream else None
        module.forward = wrap_forward(module.forward, st.plan.recompute, hooks)


def install_grad_hooks(rt: "Runtime", st: BlockState) -> None:
    for p in st.params:
        p.register_post_accumulate_grad_hook(lambda param, st=st: rt.grad_arrived(st))


def flush_grads(st: BlockState, mem: MemorySystem, make_room: Callable[[], None], step: int,
                step_groups: list[dict] | None = None) -> None:
    """Move the block's fresh gradients into its grad chunk (accumulating) and free them. The chunk
    lives where the block's update runs (``plan_bytes.grad_tier``): the host, or the device.

    ``make_room`` returns once a new host grad chunk may be allocated: when gradients are updated
    away as they come, backward waits for the optimizer rather than outgrow the host budget.
    ``step_groups`` (lockfree): the step's hyperparameters, which the update applies with them."""
    fresh = None
    while True:  # a lockfree update loop may take the chunk at any moment between these lines
        with st.lock:
            if st.grad is None and fresh is not None:
                st.grad, fresh = fresh, None
            if st.grad is not None:
                _accumulate(st, step, step_groups)
                break
        if grad_tier(st.plan) is Tier.HOST:
            make_room()  # outside the lock: it may wait for this block's own update
        fresh = mem.allocate(f"{st.block.name}.grad", st.nbytes, grad_tier(st.plan), Kind.GRAD, contiguous=True)
    if fresh is not None:
        mem.release(fresh)
    st.grad_count = 0


def _accumulate(st: BlockState, step: int, step_groups: list[dict] | None) -> None:
    """Add the parameters' gradients into the block's grad chunk (under ``st.lock``) and free them."""
    views = st.views(st.grad)
    for i, p in enumerate(st.params):
        if p.grad is None:
            continue
        if st.has_grad[i]:
            views[i].add_(p.grad)
        else:
            views[i].copy_(p.grad)
            st.has_grad[i] = True
        p.grad = None
    st.grad_step = step
    st.grad_groups = step_groups
