"""The module and autograd hooks that drive a step; each reads like the step it implements.

Forward: a streamed block acquires its slot (waiting only if the copy has not landed)
and prefetches the next ones; a resident block waits for its pending update.
Backward: a streamed block re-acquires its slot before its backward and prefetches the
previous ones. Every parameter's gradient leaves for the host chunk as soon as it is
accumulated; a block whose gradients are all in is flushed at once, the rest when
backward ends (parameters that got no gradient, e.g. an idle expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.utils.checkpoint as ckpt

from tiertrain.memory import Kind, MemorySystem, Tier
from tiertrain.runtime.block_state import BlockState

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime


def install_block_hooks(rt: "Runtime", st: BlockState) -> None:
    module = st.block.module
    if st.plan.stream:
        module.register_forward_pre_hook(lambda m, a: rt.window.acquire(st, +1))
    else:
        module.register_forward_pre_hook(lambda m, a: rt.params_ready(st))
    module.register_full_backward_pre_hook(lambda m, g: rt.backward_begins(st))
    if st.plan.recompute:
        forward = module.forward

        def recomputed(*args, **kwargs):  # H3T's rematerialisation: keep the input only
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)

        module.forward = recomputed


def install_grad_hooks(rt: "Runtime", st: BlockState) -> None:
    for p in st.params:
        p.register_post_accumulate_grad_hook(lambda param, st=st: rt.grad_arrived(st))


def flush_grads(st: BlockState, mem: MemorySystem, make_room: Callable[[], None], step: int) -> None:
    """Move the block's fresh gradients into its host grad chunk (accumulating) and free them.

    ``make_room`` returns once a new grad chunk may be allocated: when gradients are updated
    away as they come, backward waits for the optimizer rather than outgrow the host budget."""
    fresh = None
    if st.grad is None:
        make_room()  # outside the lock: it may wait for this block's own update
        fresh = mem.allocate(f"{st.block.name}.grad", st.nbytes, Tier.HOST, Kind.GRAD, contiguous=True)
    with st.lock:
        if st.grad is None:
            st.grad, fresh = fresh, None
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
    if fresh is not None:
        mem.release(fresh)
    st.grad_count = 0
