"""Plain PyTorch's delayed parameter update (ZeRO-Offload's): the reference a fixed lag (``Plan.fixed_lag``)
is checked against, in one process and over ranks."""

from __future__ import annotations

import copy

import torch


class DelayedAdamW:
    """AdamW over a copy of the model (the master) whose values the model takes a step late: after each
    backward the model gets the master's params from before that step's update, so step s computes with
    the updates of steps before s - 1. The same AdamW and hyperparameters as the tests' ``make_adamw``."""

    def __init__(self, model: torch.nn.Module) -> None:
        from tiertrain.train.optimizer import make_adamw

        self.model, self.master = model, copy.deepcopy(model)
        self.opt, _ = make_adamw(self.master, 1e-2, (0.9, 0.95), 1e-8, 0.1)
        self.param_groups = self.opt.param_groups

    def step(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.master.parameters()):
                m.grad, p.grad = p.grad, None
                p.copy_(m)
        self.opt.step()

    def zero_grad(self) -> None:
        self.model.zero_grad()
        self.opt.zero_grad()
