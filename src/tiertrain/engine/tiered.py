"""Turning a run's config into a ``tiertrain.setup`` call: budgets with sane defaults."""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn as nn

from tiertrain.engine.config import TrainConfig
from tiertrain.engine.precision import Precision
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.memory.capacity import host_available
from tiertrain.units import parse_size


def default_budgets(cfg: TrainConfig, device: torch.device) -> Budgets:
    if cfg.device_memory:
        dev = parse_size(cfg.device_memory)
    elif device.type == "cuda":
        dev = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    else:
        dev = 4 << 30
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # half the RAM, but never more than the machine can give now beside the device tier (on CPU the
    # device tier is host memory too): a default must not be refused by the capacity check
    room = host_available() - (dev if device.type == "cpu" else 0)
    host = parse_size(cfg.host_memory) if cfg.host_memory else max(0, min(ram // 2, int(0.9 * room)))
    disk_dir, disk = None, 0
    if cfg.disk:
        spec = Budgets.parse(0, 0, cfg.disk)
        disk_dir, disk = spec.disk_dir, spec.disk
        if not disk:
            raise ConfigError(f"--disk {cfg.disk} gives no size; write DIR:SIZE, e.g. /nvme/tiertrain:200GiB")
    return Budgets(dev, host, disk, disk_dir)


def setup_tiered(model: nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, precision: Precision,
                 device: torch.device, profile_step: Callable[[], None] | None = None) -> tuple[nn.Module, object]:
    """``profile_step``: one plain forward+backward at the run's batch shape, for ``--plan auto``."""
    from tiertrain.engine.setup import setup
    from tiertrain.memory.system import compute_device

    if device.type != compute_device().type:
        raise ConfigError(f"with --plan, tiertrain computes on {compute_device().type} (the device it sees), not "
                          f"--device {device.type}; drop --device, or hide the GPU (CUDA_VISIBLE_DEVICES=) to train on the CPU")

    return setup(model, opt, default_budgets(cfg, device), plan=cfg.plan, grad_accum=cfg.grad_accum,
                 max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None, update=cfg.update,
                 page_size=parse_size(cfg.page_size) if cfg.page_size else None, max_staleness=cfg.max_staleness,
                 compute_dtype=precision.name, profile_step=profile_step,
                 init_states=not cfg.resume)  # resuming: the checkpoint writes the states, once
