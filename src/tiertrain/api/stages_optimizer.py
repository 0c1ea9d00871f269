"""The one optimizer a pipelined rank's loop steps, over the stages it holds (AIAO and interleaved
schedules hold several): a real ``torch.optim.Optimizer`` whose ``param_groups`` are the user's groups,
so a scheduler drives every stage's learning rate at once, and whose ``step`` steps each stage's runtime.

The global gradient norm (clipping) spans every stage of the pipeline: each stage's runtime finds the norm
of its own gradients (over its data-parallel group), the rank combines its stages', and the pipeline's
ranks combine theirs (one number over the gloo side of the pipeline group); every stage then clips by
that norm.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tiertrain.api.tiered_optimizer import ShardedStates, TieredOptimizer
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.norm import sharded_norm


class StagesOptimizer(torch.optim.Optimizer):
    def __init__(self, source: torch.optim.Optimizer, parts: list[TieredOptimizer], pp_host: Collectives,
                 max_grad_norm: float | None) -> None:
        """``source``: the user's AdamW (its groups' hyperparameters); ``parts``: each stage's optimizer,
        built over the same groups (by index); ``pp_host``: the pipeline's ranks over gloo; ``max_grad_norm``:
        the run's declared clipping, applied at each step the loop did not clip itself."""
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [p for part in parts for p in part.param_groups[i]["params"]]}
                  for i, g in enumerate(source.param_groups)]
        super().__init__(groups, dict(source.defaults))
        for mine, theirs in zip(self.param_groups, source.param_groups):  # one dict per group: a scheduler built
            theirs["params"] = mine["params"]                              # over either writes what both read
        self.param_groups = source.param_groups
        self.parts, self._pp_host, self._max_grad_norm = parts, pp_host, max_grad_norm
        self._clipped = False
        self.loss_scaler = None  # stages run in fp32 or bf16: no loss scale to keep
        for part in parts:
            part._rt.param_groups = self.param_groups  # live: what a scheduler writes, every stage's next update reads

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            if self._max_grad_norm is not None and not self._clipped:
                self.clip_grad_norm_(self._max_grad_norm)
            for part in self.parts:
                part.step()
        finally:
            self._clipped = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clipped = False
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise ShardedStates("a pipelined run's optimizer states are split over its stages' ranks, and torch's one-dict "
                            "format would need every rank's at once: save the run with tiertrain.save_pipeline(run, "
                            "out, step) and resume it with tiertrain.load_pipeline(run, out)")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "parts"):  # torch's constructor adds the groups it was given
            raise ValueError("a pipelined run's parameter groups are fixed when tiertrain.pipeline builds its stages")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state_dict()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of every stage's gradients together; each stage clips by it at the next step."""
        norms = [part._rt.clip_grad_norm_(max_norm, norm_type).float().cpu() for part in self.parts]
        total = sharded_norm([(self._pp_host, norms)], [], norm_type)  # the stages' norms over the pipeline
        for part in self.parts:
            part._rt.norm.take(total, max_norm)
        self._clipped = True
        return total

