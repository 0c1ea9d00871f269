"""A profile of a model too big to run, from one of its blocks run for real.

``plan auto`` measures the plain model; a model built on the meta device (larger than the
host) or one whose plain step does not fit the device cannot be. Its blocks are structurally
equal, so one real copy of the first block, run at the batch shape in the run's precision on
the compute device, times them all: real kernels, the real dtype, the memory-bound work a
FLOP count misses (the analytic estimate alone was 83% under a small model's step on CPU).
The embeddings and head are not run: their analytic times are scaled by the block's
measured-to-analytic ratio, which carries the machine's efficiency at this shape and dtype.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn as nn

from tiertrain.engine.measure.analytic import analytic_blocks, flop_estimate
from tiertrain.engine.measure.model import measure_profile
from tiertrain.engine.precision import Precision
from tiertrain.models.config import ModelConfig
from tiertrain.models.init import init_in_place
from tiertrain.planner.profile import MachineProfile, Profile
from tiertrain.runtime.blocks import Block


class _Captured(Exception):
    """Stops the model's forward once the first block's inputs are known."""


class BlockInputsUnknown(Exception):
    """The model's forward could not be run up to its first block to learn the block's inputs."""


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


def real_copy(block: nn.Module, device: torch.device) -> nn.Module:
    """The block with parameters of its own on ``device``, initialised as setup initialises a
    meta-built model (the values only need to be finite and typical)."""
    meta = next(block.parameters()).is_meta
    twin = copy.deepcopy(block)
    if not meta:
        return twin.to(device)
    twin = twin.to_empty(device=device)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            init_in_place(name, p)
    return twin


def measure_one_block(model: nn.Module, blocks: list[Block], cfg: ModelConfig | None, shape: tuple[int, int],
                      precision: str, device: torch.device, machine: MachineProfile, flops: float,
                      key: str) -> Profile:
    """Every repeated block as the first one measures; the rest (embeddings, head) as the analytic
    estimate (``cfg``'s, or ``_flop_estimate``'s for another model) scaled by the block's
    measured-to-estimated time."""
    args, kwargs = block_inputs(model, blocks[0].module, shape)
    twin = real_copy(blocks[0].module, device)
    args = tuple(_real(a, device, hidden=i == 0) for i, a in enumerate(args))
    kwargs = {k: _real(v, device, hidden=not args and k == "hidden_states") for k, v in kwargs.items()}
    autocast = Precision(precision, device.type).autocast

    def step() -> None:
        with autocast():
            out = twin(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().sum().backward()

    holder = nn.ModuleList([twin])  # measure_profile reads the device off a model and clears its grads
    one = measure_profile(holder, [Block(blocks[0].name, twin, list(twin.named_parameters())), Block("rest", None, [])],
                          step, machine, precision, key, page=0).blocks[0]
    if isinstance(cfg, ModelConfig):
        est, est_rest = analytic_blocks(cfg, shape[0], shape[1], precision, flops)
        block_s = est[0].forward_s
    else:
        hidden = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.requires_grad)
        block_s, est_rest = flop_estimate(blocks, shape, hidden.shape[-1], precision, flops)
    scale = one.forward_s / max(block_s, 1e-12)
    rest = dataclasses.replace(est_rest, forward_s=est_rest.forward_s * scale, backward_s=est_rest.backward_s * scale)
    repeated = tuple(dataclasses.replace(one, name=b.name) for b in blocks[:-1])
    return Profile(repeated, rest, machine, compute_dtype=precision, key=key)
