"""A profile of a model too big to run, from one of its blocks run for real.

``plan auto`` measures the plain model; a model built on the meta device (larger than the host), or
one whose plain step would not fit (``bounds``), cannot be. Its blocks are structurally equal, so one
real copy of the first block, run in the run's precision on the compute device, times them all: real
kernels, the real dtype, the memory-bound work a FLOP count misses. It runs at the batch shape where
that fits ``MeasureBounds``, else at a reduced one (fewer rows, then fewer tokens per row), scaled to
the run's shape: times by the roofline time of the block's FLOPs and bytes at each shape, saved bytes
by a fit over three token counts (constant, linear and quadratic in the sequence, linear in rows).
The embeddings and head are not run: their roofline times are scaled by the block's measured-to-
roofline ratio, which carries the machine's efficiency at this shape and dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from tiertrain.measure.analytic import (HIDDEN_BYTES, Work, block_work, generic_rest, generic_work,
                                               rest_work, saved_bytes)
from tiertrain.measure.bounds import MIN_TOKENS, UNBOUNDED, MeasureBounds, RunCost, pick_shape, run_cost
from tiertrain.measure.model import _SavedBytes, measure_profile
from tiertrain.runtime.precision import Precision
from tiertrain.models.accounting import embedding_params, largest_params
from tiertrain.models.config import ModelConfig
from tiertrain.models.init import init_in_place
from tiertrain.planner.machine import Machine
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.precisions import BYTES
from tiertrain.runtime.blocks import Block
from tiertrain.units import format_bytes


class _Captured(Exception):
    """Stops the model's forward once the first block's inputs are known."""


class BlockInputsUnknown(Exception):
    """The model's forward could not be run up to its first block to learn the block's inputs."""


class BeyondBounds(Exception):
    """Not even the smallest shape of one block can be measured within the bounds."""


InputsAt = Callable[[tuple[int, int]], tuple[tuple, dict]]
"""The arguments the first block is called with for token ids of a shape (meta tensors will do: only
their shapes and dtypes are read)."""


def block_inputs(model: nn.Module, block: nn.Module, shape: tuple[int, int]) -> tuple[tuple, dict]:
    """The arguments the model passes its first block, for token ids of ``shape``: the model runs
    up to that block where its parameters are (meta tensors only carry shapes) and stops there."""
    seen: dict[str, Any] = {}

    def grab(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    where = next(model.parameters()).device
    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.zeros(shape, dtype=torch.long, device=where))
    except _Captured:
        pass
    except RuntimeError as exc:  # e.g. a transformers mask helper that reads a value (.item()) on meta
        raise BlockInputsUnknown(f"the model's forward fails before its first block on the meta device ({exc})") from None
    finally:
        handle.remove()
    if "args" not in seen:
        raise BlockInputsUnknown("the model's forward never called its first block")
    return seen["args"], seen["kwargs"]


def model_inputs(model: nn.Module, block: nn.Module) -> InputsAt:
    """The block's arguments as the model's own forward passes them (``block_inputs``)."""
    return lambda shape: block_inputs(model, block, shape)


def _real(x: Any, device: torch.device, hidden: bool = False) -> Any:
    """A device tensor of ``x``'s shape and dtype: the hidden state random and needing grad (as a
    block's input does in training), other floats (masks, rotary tables) zeros, booleans true,
    other integers zero; tuples and lists element by element; a KV cache none; other values as
    they are."""
    if isinstance(x, (tuple, list)):
        return type(x)(_real(v, device) for v in x)
    if type(x).__name__.endswith("Cache"):  # a transformers KV cache: training runs without one
        return None
    if not isinstance(x, torch.Tensor):
        return x
    if hidden:
        return torch.randn(x.shape, dtype=x.dtype, device=device).requires_grad_(True)
    if x.dtype is torch.bool:
        return torch.ones(x.shape, dtype=torch.bool, device=device)
    return torch.zeros(x.shape, dtype=x.dtype, device=device)


def _fill(name: str, p: torch.Tensor, tile: torch.Tensor) -> None:
    """Matrices get a random N(0, 0.02) tile copied over them (memory-bound: 20x faster than drawing
    every value, and the kernels that time them do not look at the values); the rest as setup does."""
    if p.dim() < 2:
        init_in_place(name, p)
        return
    flat, n = p.view(-1), tile.numel()
    rows, left = divmod(flat.numel(), n)
    if rows:
        flat[: rows * n].view(rows, n).copy_(tile.expand(rows, n))
    flat[rows * n:].copy_(tile[:left])


def real_copy(block: nn.Module, device: torch.device) -> nn.Module:
    """The block with parameters of its own on ``device``, with finite, typical values."""
    meta = next(block.parameters()).is_meta
    twin = copy.deepcopy(block)
    if not meta:
        return twin.to(device)
    twin = twin.to_empty(device=device)
    tile = torch.randn(65537, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(device)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            _fill(name, p, tile)
    return twin


@dataclass(frozen=True)
class _Shape:
    """What one block's run at a batch shape is estimated to do: its work and its saved bytes."""

    work: Callable[[int, int], Work]
    saved: Callable[[int, int], int]
    rest: Callable[[int, int], tuple[Work, BlockProfile]]


def _shape_model(model: nn.Module, blocks: list[Block], cfg: ModelConfig | None, precision: str) -> _Shape:
    if isinstance(cfg, ModelConfig):
        def rest(b: int, s: int) -> tuple[Work, BlockProfile]:
            w = rest_work(cfg, b, s, precision)
            logits = 2 * b * s * cfg.vocab_size * BYTES[precision]
            return w, BlockProfile("rest", 0.0, 0.0, embedding_params(cfg), logits, b * s * cfg.d_model * HIDDEN_BYTES,
                                   flops=w.flops, traffic_bytes=w.traffic_bytes, largest=largest_params(cfg)[1])

        return _Shape(lambda b, s: block_work(cfg, b, s, precision), lambda b, s: saved_bytes(cfg, b, s, precision),
                      rest)
    mcfg = getattr(model, "config", None)
    d = _config_int(mcfg, "hidden_size", "n_embd", "d_model")
    heads = _config_int(mcfg, "num_attention_heads", "n_head") or 1
    return _Shape(lambda b, s: generic_work(blocks, (b, s), d, heads, precision),
                  lambda b, s: int(generic_work(blocks, (b, s), d, heads, precision).traffic_bytes // 2),
                  lambda b, s: generic_rest(blocks, (b, s), d, precision))


def _config_int(cfg: Any, *names: str) -> int:
    return next((int(getattr(cfg, n)) for n in names if isinstance(getattr(cfg, n, None), int)), 0)


def profile_one_block(model: nn.Module, blocks: list[Block], cfg: ModelConfig | None, shape: tuple[int, int],
                      precision: str, device: torch.device, here: Machine, key: str,
                      bounds: MeasureBounds = UNBOUNDED, inputs: InputsAt | None = None) -> Profile:
    """Every repeated block as the first one measures, at the largest shape ``bounds`` allow; the
    rest by its roofline time scaled by the block's measured-to-roofline ratio. ``BeyondBounds``
    where no shape fits. ``inputs``: the block's arguments at a shape, where not the model's forward's
    (``model_inputs``): a running model's first step shows them (``engine.first_step_auto``).

    The time a shape would take is its roofline time at ``here``'s rates times the block's own
    efficiency, found by one timed pass at the smallest shape first (the roofline alone was 12x short
    of a GPT3-13B block's bf16 time on our CPU, and a bound it is that short of is no bound). So the
    measuring takes at most the bounds plus that one pass."""
    est = _shape_model(model, blocks, cfg, precision)
    at = inputs or model_inputs(model, blocks[0].module)
    params = sum(p.numel() for _, p in blocks[0].params)
    width = _width(model, blocks, cfg)
    small = (1, min(shape[1], MIN_TOKENS))

    def cost(b: int, s: int, steps: int, efficiency: float = 1.0, fresh: bool = False) -> RunCost:
        forward = est.work(b, s).seconds(here, precision) * efficiency
        fit = 0.0 if (b, s) == tuple(shape) else 1.75 * forward  # _saved_fit's forwards at s, s/2, s/4
        c = run_cost(params, precision, est.saved(b, s), b * s * width * HIDDEN_BYTES, forward, steps, fresh)
        return RunCost(c.memory, c.seconds + fit)

    start = time.perf_counter()
    floor = cost(*small, 1, fresh=True)  # before anything is allocated: the copy's weights are drawn too
    if not floor.within(bounds):
        raise BeyondBounds(f"one block ({params / 1e6:.0f}M params) would hold {format_bytes(floor.memory)} and take "
                           f"{floor.seconds:.1f} s at 1 x {small[1]} tokens, beyond {bounds.describe()}")
    twin = real_copy(blocks[0].module, device)
    efficiency = _pass_seconds(at, twin, small, precision, device) / (
        3 * max(est.work(*small).seconds(here, precision), 1e-12))
    left = MeasureBounds(bounds.memory, bounds.seconds - (time.perf_counter() - start))
    picked = pick_shape(lambda b, s, k: cost(b, s, k, efficiency), shape[0], shape[1], left)
    if picked is None:
        raise BeyondBounds(f"one block ({params / 1e6:.0f}M params) runs {efficiency:.1f}x its roofline time here, "
                           f"so even 1 x {small[1]} tokens would take beyond {bounds.describe()}")
    b, s, steps = picked
    one = _measure(at, blocks, twin, (b, s), precision, device, key, steps)
    if (b, s) != tuple(shape):
        one = _scaled_up(one, _saved_fit(at, twin, b, s, precision, device), (b, s), shape, est, here,
                         precision)
    return _assemble(one, blocks, est, shape, here, precision, key,
                     "one block measured" if (b, s) == tuple(shape) else
                     f"one block measured at {b} x {s} tokens (of {shape[0]} x {shape[1]}: the run's shape is beyond "
                     f"{bounds.describe()}), scaled by FLOPs and bytes")


def _assemble(one: BlockProfile, blocks: list[Block], est: _Shape, shape: tuple[int, int], here: Machine,
              precision: str, key: str, how: str) -> Profile:
    """Every block as ``one``; the rest block's roofline time scaled by ``one``'s measured-to-roofline ratio."""
    work = est.work(*shape)
    one = dataclasses.replace(one, flops=work.flops, traffic_bytes=work.traffic_bytes)
    efficiency = one.forward_s / max(work.seconds(here, precision), 1e-12)
    head, rest = est.rest(*shape)
    rest_s = head.seconds(here, precision) * efficiency
    rest = dataclasses.replace(rest, forward_s=rest_s, backward_s=2 * rest_s)
    repeated = tuple(dataclasses.replace(one, name=blk.name) for blk in blocks[:-1])
    return Profile(repeated, rest, here.rates(), compute_dtype=precision, key=key, source=how)


def _pass_seconds(at: InputsAt, twin: nn.Module, shape: tuple[int, int], precision: str, device: torch.device) -> float:
    """One forward+backward of the twin at ``shape``, timed. On a CPU the first, with its warm-up
    (allocations), so a bound drawn from it errs towards shorter measurements. On a GPU the second:
    the first pays CUDA's lazy set-up (cuBLAS handles, kernel loading), which made a 64M-param block
    read 16,000x its roofline time on an H200, so that no shape fitted 5 s and the planner fell back
    to its analytic profile (2026-11-27)."""
    args, kwargs = _inputs(at, shape, device)
    autocast = Precision(precision, device.type).autocast
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2 if device.type == "cuda" else 1):
        sync()
        t = time.perf_counter()
        with autocast():
            out = twin(*args, **kwargs)
        (out[0] if isinstance(out, (tuple, list)) else out).float().sum().backward()
        sync()
        seconds = time.perf_counter() - t
        twin.zero_grad(set_to_none=True)
    return seconds


def model_cost(model: nn.Module, blocks: list[Block], shape: tuple[int, int], precision: str, here: Machine,
               weights_held: bool) -> RunCost:
    """What profiling the plain model (``measure_profile``, three timed steps) would hold and take,
    estimated from its blocks' work. ``weights_held``: its weights are already where it runs (the
    host, on a CPU-only machine), so only what the run adds counts against the free memory."""
    cfg = getattr(model, "config", None)
    est = _shape_model(model, blocks, cfg if isinstance(cfg, ModelConfig) else None, precision)
    b, s = shape
    n = len(blocks) - 1
    rest_w, rest = est.rest(b, s)
    params = sum(p.numel() for p in model.parameters())
    forward = n * est.work(b, s).seconds(here, precision) + rest_w.seconds(here, precision)
    hidden = b * s * _width(model, blocks, cfg if isinstance(cfg, ModelConfig) else None) * HIDDEN_BYTES
    cost = run_cost(params, precision, n * est.saved(b, s) + rest.act_bytes, hidden, forward, 3, False)
    return RunCost(cost.memory - (4 * params if weights_held else 0), cost.seconds)


def _width(model: nn.Module, blocks: list[Block], cfg: ModelConfig | None) -> int:
    if isinstance(cfg, ModelConfig):
        return cfg.d_model
    return _config_int(getattr(model, "config", None), "hidden_size", "n_embd", "d_model") or 1


def _inputs(at: InputsAt, shape: tuple[int, int], device: torch.device) -> tuple[tuple, dict]:
    args, kwargs = at(shape)
    args = tuple(_real(a, device, hidden=i == 0) for i, a in enumerate(args))
    kwargs = {k: _real(v, device, hidden=not args and k == "hidden_states") for k, v in kwargs.items()}
    return args, kwargs


def _measure(at: InputsAt, blocks: list[Block], twin: nn.Module, shape: tuple[int, int], precision: str,
             device: torch.device, key: str, steps: int) -> BlockProfile:
    """The twin's forward, backward and recompute times and saved bytes at ``shape``."""
    args, kwargs = _inputs(at, shape, device)
    autocast = Precision(precision, device.type).autocast

    def step() -> None:
        with autocast():
            out = twin(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().sum().backward()

    holder = nn.ModuleList([twin])  # measure_profile reads the device off a model and clears its grads
    machine = MachineProfile(1.0, 1.0, 1.0, 1.0, 1.0)  # not read: only the block's figures are kept
    return measure_profile(holder, [Block(blocks[0].name, twin, list(twin.named_parameters())), Block("rest", None, [])],
                           step, machine, precision, key, page=0, steps=steps).blocks[0]


def _saved_fit(at: InputsAt, twin: nn.Module, b: int, s: int, precision: str,
               device: torch.device) -> np.ndarray:
    """(c0, c1, c2) with saved bytes = c0 + rows / b * (c1 s + c2 s^2), from forward passes at ``b`` rows
    and s, s/2 and s/4 tokens: the constant is what does not grow with tokens (none in our blocks)."""
    params = {p.untyped_storage().data_ptr() for p in twin.parameters()}
    autocast = Precision(precision, device.type).autocast
    points = sorted({max(1, s // k) for k in (1, 2, 4)})
    counts = []
    for tokens in points:
        args, kwargs = _inputs(at, (b, tokens), device)
        counter = _SavedBytes(params)
        with counter.hooks(), autocast():
            twin(*args, **kwargs)
        counts.append(counter.bytes)
    powers = np.array([[t**k for k in range(len(points))] for t in points], dtype=np.float64)
    coef = np.linalg.solve(powers, np.array(counts, dtype=np.float64))
    return np.pad(coef, (0, 3 - len(coef)))


def _scaled_up(one: BlockProfile, fit: np.ndarray, measured: tuple[int, int], full: tuple[int, int], est: _Shape,
               here: Machine, precision: str) -> BlockProfile:
    """The block measured at ``measured`` as it would be at ``full``."""
    (b, s), (B, S) = measured, full
    k = est.work(B, S).seconds(here, precision) / est.work(b, s).seconds(here, precision)
    saved = fit[0] + B / b * (fit[1] * S + fit[2] * S * S)
    return dataclasses.replace(one, forward_s=one.forward_s * k, backward_s=one.backward_s * k,
                               recompute_s=None if one.recompute_s is None else one.recompute_s * k,
                               act_bytes=int(round(saved)), hidden_bytes=one.hidden_bytes * B * S // (b * s))


def measure_one_block(model: nn.Module, blocks: list[Block], cfg: ModelConfig | None, shape: tuple[int, int],
                      precision: str, device: torch.device, machine: MachineProfile, flops: float,
                      key: str) -> Profile:
    """The benchmarks' entry (``bench planner --part estimate``): the block at the run's shape, as
    before bounds existed, with ``machine``'s rates in the profile."""
    from tiertrain.measure.machine import probe

    got = profile_one_block(model, blocks, cfg, shape, precision, device, probe(), key, UNBOUNDED)
    return dataclasses.replace(got, machine=machine)
