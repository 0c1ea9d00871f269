"""Turning a run's config into a ``tiertrain.setup`` call: budgets with sane defaults."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from tiertrain.train.config import TrainConfig
from tiertrain.runtime.precision import Precision
from tiertrain.errors import ConfigError
from tiertrain.api.machine_budgets import TakenBudgets, machine_budgets
from tiertrain.memory import Budgets
from tiertrain.units import parse_size


def default_budgets(cfg: TrainConfig, device: torch.device) -> TakenBudgets:
    """The run's budgets: the flags', the rest from the machine (``engine.budgets``)."""
    disk_dir, disk = None, 0
    if cfg.disk:
        spec = Budgets.parse(0, 0, cfg.disk)
        disk_dir, disk = spec.disk_dir, spec.disk
        if not disk:
            raise ConfigError(f"--disk {cfg.disk} gives no size; write DIR:SIZE, e.g. /nvme/tiertrain:200GiB")
    return machine_budgets(device, parse_size(cfg.device_memory) if cfg.device_memory else None,
                           parse_size(cfg.host_memory) if cfg.host_memory else None, disk, disk_dir)


def setup_tiered(model: nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, precision: Precision,
                 device: torch.device, budgets: Budgets,
                 profile_step: Callable[[], None] | None = None) -> tuple[nn.Module, object]:
    """``profile_step``: one plain forward+backward at the run's batch shape, for ``--plan auto``. A run
    with no plan over several ranks (torchrun) is plain data parallel: every block resident on each rank's
    device and replicated, its gradients averaged over the ranks, as DDP trains."""
    from tiertrain.api.setup import setup
    from tiertrain.memory.system import compute_device

    if device.type != compute_device().type:
        raise ConfigError(f"with --plan, tiertrain computes on {compute_device().type} (the device it sees), not "
                          f"--device {device.type}; drop --device, or hide the GPU (CUDA_VISIBLE_DEVICES=) to train on the CPU")

    return setup(model, opt, budgets, plan=cfg.plan or "resident", shard=None if cfg.plan else False,
                 grad_accum=cfg.grad_accum,
                 max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None, update=cfg.update,
                 page_size=parse_size(cfg.page_size) if cfg.page_size else None, max_staleness=cfg.max_staleness,
                 compute_dtype=precision.name, profile_step=profile_step, ep=cfg.ep if cfg.ep > 1 else None,
                 reduce_dtype=cfg.reduce_dtype, shard_group=cfg.shard_group or None,
                 init_states=not cfg.resume)  # resuming: the checkpoint writes the states, once
