"""Dynamic loss scaling for fp16 compute under a plan.

``torch.amp.GradScaler`` cannot serve here: it unscales ``param.grad``, and ours leave
the parameters for host chunks as backward produces them. So the scale is applied
where the user's loop cannot miss it, on the gradient entering the model's outputs
(the forward values are untouched, so ``loss.item()`` still reads the true loss), and
undone in the optimizer's gradient coefficient. The growth/back-off rule, its defaults
and its state-dict keys are GradScaler's, so checkpoints carry the scale either way.
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0   # finite steps since the last change
        self.skipped = 0          # steps skipped for non-finite gradients, over the run

    def update(self, found_inf: bool) -> None:
        """GradScaler's rule: back off at once on an overflow, grow after ``growth_interval`` clean steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def get_scale(self) -> float:
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.growth_tracker = int(state.get("_growth_tracker", 0))

    def wrap_outputs(self, out: Any) -> Any:
        """The model's outputs, each differentiable tensor passing its gradient on scaled."""
        if isinstance(out, torch.Tensor):
            return _ScaleGrad.apply(out, self) if out.requires_grad and out.is_floating_point() else out
        if isinstance(out, dict):  # transformers' ModelOutput is a dict that keeps attributes in step
            for key in list(out.keys()):
                out[key] = self.wrap_outputs(out[key])
            return out
        if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
            return type(out)(*(self.wrap_outputs(o) for o in out))
        if isinstance(out, (tuple, list)):
            return type(out)(self.wrap_outputs(o) for o in out)
        return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, scaler: LossScaler) -> torch.Tensor:
        ctx.scale = scaler.scale  # the scale this micro-batch was computed under
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None
