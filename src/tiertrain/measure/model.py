"""Measured profiles: a few plain forward+backward passes of the real model, timed per block.

This runs the model, so it lives in the engine; the planner only reads the ``Profile``
it produces (DESIGN: the planner imports no runtime code). Hooks on each block record its
forward and backward time, the bytes autograd saves inside it (counted once per storage,
parameters excluded), its input's bytes (all that recompute keeps) and the order blocks are
called in. The embeddings and head are what is left of the step. Profiles are cached per
machine + model + batch shape + precision, so only the first ``--plan auto`` run pays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import socket
import statistics
import time
from contextlib import ExitStack
from typing import Callable

import torch
import torch.nn as nn

from tiertrain import typed
from tiertrain.measure import cache
from tiertrain.measure.load import LoadMeter
from tiertrain.errors import ConfigError
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.parallel.expert_layer import expert_layers
from tiertrain.runtime.blocks import Block, block_numel
from tiertrain.runtime.streams import CudaStreams, Streams, in_streams

log = logging.getLogger("tiertrain")


def profile_key(model: nn.Module, shape: tuple[int, ...], precision: str, device: torch.device) -> str:
    """Which cached profile a run may reuse: same host, device kind, model structure, batch shape, dtype
    (v4: profiles record each block's largest parameter)."""
    structure = hashlib.sha256(repr([(n, tuple(p.shape)) for n, p in model.named_parameters()]).encode()).hexdigest()
    name = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
    return f"v4/{socket.gethostname()}/{device.type}/{name}-{structure[:12]}/{'x'.join(map(str, shape))}/{precision}"


class _SavedBytes:
    """A saved-tensor hook pair that adds up what autograd keeps, once per storage, parameters aside;
    and autocast's 16-bit copies of them: a tiered run computes with 16-bit parameters in their device
    slots, so its autograd keeps those, not copies (they cost 2 bytes per weight per block)."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.seen, self.bytes = params, set(), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen and not self._cast_of_param(t):
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def _cast_of_param(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) is a dtype copy made straight from a parameter."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
            return False
        leaf = getattr(fn.next_functions[0][0], "variable", None)
        return leaf is not None and leaf.untyped_storage().data_ptr() in self.params

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class _BlockTimer:
    """Per-block hooks: wall time of forward and backward; with ``count`` on, also the bytes saved
    inside each block, its input's bytes and the call order (counting is kept out of timed passes)."""

    def __init__(self, blocks: list[Block], params: set[int], sync: Callable[[], None]) -> None:
        self.blocks, self.params, self.sync = blocks, params, sync
        n = len(blocks)
        self.fwd: list[list[float]] = [[] for _ in range(n)]
        self.bwd: list[list[float]] = [[] for _ in range(n)]
        self.rec: list[list[float]] = [[] for _ in range(n)]   # recomputes, in the checkpointed pass
        self.in_backward = False
        self.saved, self.hidden = [0] * n, [0] * n
        self.order: list[int] = []
        self.count = False
        self.rows = 0  # of the batch a block was last given (its first tensor's first dimension)
        self._t0, self._counter, self._ctx = 0.0, _SavedBytes(params), ExitStack()

    def attach(self) -> list:
        handles = []
        for i, b in enumerate(self.blocks):
            handles += [b.module.register_forward_pre_hook(lambda m, a, i=i: self._pre(i, a)),
                        b.module.register_forward_hook(lambda m, a, o, i=i: self._post(i)),
                        b.module.register_full_backward_pre_hook(lambda m, g, i=i: self._bpre()),
                        b.module.register_full_backward_hook(lambda m, gi, go, i=i: self._bpost(i))]
        return handles

    def clear_times(self) -> None:
        for times in (*self.fwd, *self.bwd):
            times.clear()

    def _pre(self, i: int, args: tuple) -> None:
        self.in_backward = False
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 1), None)
        self.rows = first.shape[0] if first is not None else 0
        if self.count:
            self.order.append(i)
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.hidden[i] = first.numel() * first.element_size() if first is not None else 0
            self._counter = _SavedBytes(self.params)
            self._ctx.enter_context(self._counter.hooks())
        self.sync()
        self._t0 = time.perf_counter()

    def _post(self, i: int) -> None:
        self.sync()
        self.fwd[i].append(time.perf_counter() - self._t0)
        if self.count:
            self._ctx.close()
            self.saved[i] = max(self.saved[i], self._counter.bytes)

    def _bpre(self) -> None:
        self.in_backward = True
        self.sync()
        self._t0 = time.perf_counter()

    def _bpost(self, i: int) -> None:
        self.sync()
        self.bwd[i].append(time.perf_counter() - self._t0)


def _checkpointed(timer: _BlockTimer) -> ExitStack:
    """Run each block under non-reentrant checkpoint while the stack is open, timing the second
    call of its forward, the one backward makes (the recompute)."""
    from torch.utils.checkpoint import checkpoint

    stack = ExitStack()
    for i, b in enumerate(timer.blocks):
        plain = b.module.forward

        def timed(*a, f=plain, i=i, **k):
            in_backward, t = timer.in_backward, time.perf_counter()
            try:
                return f(*a, **k)
            finally:  # checkpoint stops a recompute early, by an exception, once it has what backward needs
                if in_backward:
                    timer.sync()
                    timer.rec[i].append(time.perf_counter() - t)

        b.module.forward = lambda *a, f=timed, **k: checkpoint(f, *a, use_reentrant=False, **k)
        stack.callback(delattr, b.module, "forward")
    return stack


STREAM_COUNTS = (2, 4)  # STRONGHOLD's streams tried per block (its executors: a few, as device memory allows)


def _stream_ratios(timer: _BlockTimer, step: Callable[[], None], steps: int, sync: Callable[[], None],
                   fwd: list[float], bwd: list[float],
                   make: Callable[[int, torch.device], Streams] = CudaStreams) -> list[tuple[tuple[int, float], ...]]:
    """Each block's forward and backward with its batch over each of ``STREAM_COUNTS`` CUDA streams
    (``runtime.streams``; ``make``: a stand-in), as a fraction of one stream's; a count the batch has too
    few rows for is left out."""
    out: list[list[tuple[int, float]]] = [[] for _ in timer.blocks]
    # a block holding experts is refused over streams (its routing sees the batch): none measured, so no plan
    # runs the model over streams (``planner.streams``)
    tried = [i for i, b in enumerate(timer.blocks) if not expert_layers(b.module)]
    for n in (n for n in STREAM_COUNTS if n <= timer.rows):
        timer.clear_times()
        with ExitStack() as stack:
            for i in tried:
                module = timer.blocks[i].module
                module.forward = in_streams(module.forward, n, make(n, next(module.parameters()).device))
                stack.callback(delattr, module, "forward")
            for _ in range(steps):
                _timed(step, sync)
        for i in tried:
            one = fwd[i] + bwd[i]
            out[i].append((n, (statistics.median(timer.fwd[i]) + statistics.median(timer.bwd[i])) / one if one else 1.0))
    return [tuple(r) for r in out]


def measure_profile(model: nn.Module, blocks: list[Block], step: Callable[[], None], machine: MachineProfile,
                    precision: str, key: str, page: int, steps: int = 3) -> Profile:
    """Warm up with one ``step`` (a forward+backward at the run's shape), count saved bytes and the
    call order in a second, then time ``steps`` plain steps, and ``steps`` with every block
    checkpointed to time its recompute. Gradients accumulate in
    place between steps, as in a run, and are dropped at the end."""
    repeated, rest = blocks[:-1], blocks[-1]
    cuda = next(model.parameters()).is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = {p.untyped_storage().data_ptr() for b in blocks for _, p in b.params}
    timer = _BlockTimer(repeated, params, sync)
    outside = _SavedBytes(params)   # what the embeddings and head save
    handles = timer.attach()
    med = statistics.median
    try:
        step()
        timer.count = True
        with outside.hooks():       # the blocks' own counters, entered later, take their tensors
            step()
        timer.count = False
        timer.clear_times()
        totals = [_timed(step, sync) for _ in range(steps)]
        fwd, bwd = [med(t) for t in timer.fwd], [med(t) for t in timer.bwd]
        with _checkpointed(timer):
            for _ in range(steps):
                _timed(step, sync)
        recompute = [med(t) for t in timer.rec]
        ratios = _stream_ratios(timer, step, steps, sync, fwd, bwd) if cuda else [()] * len(repeated)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    numel = [block_numel(b) for b in blocks]
    largest = [max((p.numel() for _, p in b.params), default=0) for b in blocks]
    out = tuple(BlockProfile(b.name, fwd[i], bwd[i], numel[i], timer.saved[i], timer.hidden[i], recompute[i],
                             largest=largest[i], stream_ratio=ratios[i]) for i, b in enumerate(repeated))
    calls = [timer.order.count(i) for i in range(len(repeated))]
    left = max(med(totals) - sum(c * (b.forward_s + b.backward_s) for c, b in zip(calls, out)), 0.0)
    rest_profile = BlockProfile(rest.name, left / 3, 2 * left / 3, numel[-1], outside.bytes, 0, largest=largest[-1])
    return Profile(out, rest_profile, machine, compute_dtype=precision, key=key, page=page,
                   order=tuple(timer.order))


def _timed(step: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    t = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - t


def cached_profile(key: str, measure: Callable[[], Profile], use_cache: bool = True) -> tuple[Profile, bool]:
    """(profile, whether it came from the cache). A damaged entry is measured again. A profile
    measured while other processes took a quarter of the cores or more is used once and not kept,
    as a busy machine probe is not (``load``: a busy probe read this VM's rates 3x low): every later
    run of the model at that shape would plan from it."""
    found = cache.load("profiles", key) if use_cache else None
    if found is not None:
        try:
            return typed.load(Profile, found, "cached profile"), True
        except ConfigError:
            pass
    with LoadMeter() as meter:
        profile = measure()
    if meter.load is not None and meter.load.busy:
        log.warning("the machine was busy while the model was profiled (others used %.1f of %d cores): the "
                    "profile is used once and not cached", meter.load.others_cores, meter.load.cores)
        profile = dataclasses.replace(profile, busy=meter.load.others_cores)
    elif not profile.source.startswith("FLOP estimate"):  # an estimate costs nothing to make again
        cache.store("profiles", key, dataclasses.asdict(profile))
    return profile, False
