"""Compute precision: autocast context and loss scaling, chosen once per run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

from tiertrain.errors import ConfigError
from tiertrain.memory.system import compute_device
from tiertrain.precisions import torch_dtype


@dataclass(frozen=True)
class Precision:
    name: str
    device_type: str

    def autocast(self) -> ContextManager[None]:
        """fp32 runs without autocast; bf16/fp16 autocast with fp32 weights (the master copy)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=torch_dtype(self.name))

    def grad_scaler(self, tiered: bool = False) -> torch.amp.GradScaler:
        """Dynamic loss scaling for plain fp16; a disabled scaler (a no-op) otherwise. A tiered run
        scales inside the runtime (its gradients leave the parameters), so it gets a disabled one."""
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16" and not tiered)


def choose_precision(requested: str | None, device: torch.device) -> Precision:
    name = requested or ("bf16" if device.type == "cuda" else "fp32")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU does not support bf16; use --precision fp16")
    return Precision(name=name, device_type=device.type)


def choose_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    if requested == "auto":
        return compute_device()
    return torch.device(requested)
