"""What every rank of a run must hold alike before its groups are built: the model, the resolved plan
and the options that decide which collectives a step issues. A rank started with another
``--grad-accum`` or plan would issue other collectives, in another order: a hang, or an error read as a
lost rank. So the ranks compare them at setup, and a mismatch is one message naming the field."""

from __future__ import annotations

import hashlib
import json

from torch import nn

from tiertrain.parallel import Collectives, collectives_for
from tiertrain.parallel.agree import same_on_every_rank
from tiertrain.plan import Plan
from tiertrain.plan.options import RunOptions

FIX = "start every rank with the same model, plan and flags (torchrun gives each rank the same command line)"


def run_fields(model: nn.Module, plan: Plan, options: RunOptions) -> dict[str, str]:
    """The fields compared, each as text: the model's signature (its parameters' names, shapes and
    dtypes), the options a step's collectives depend on, and the plan field by field (its name aside;
    of what resolving decided, how gradients are held: the pool's count follows each rank's budgets)."""
    shapes = "\n".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    fields = {"the model (its parameters' names, shapes and dtypes)": hashlib.sha256(shapes.encode()).hexdigest()[:16],
              "gradient accumulation": str(options.grad_accum), "clipping": str(options.max_grad_norm),
              "training": str(options.train), "update mode": plan.update, "precision": plan.compute_dtype}
    laid_out = json.loads(plan.to_json())
    for key in ("name", "resolved", "update", "compute_dtype", "beside_pool", "stash"):
        laid_out.pop(key, None)
    fields |= {f"the plan's {key}": json.dumps(value, sort_keys=True) for key, value in laid_out.items()}
    fields["how the plan holds gradients"] = plan.resolved.grads if plan.resolved is not None else "unresolved"
    return fields


def check_ranks_agree(model: nn.Module, plan: Plan, options: RunOptions) -> None:
    same_on_every_rank("the run's settings", run_fields(model, plan, options), FIX)


def agreed_collectives(model: nn.Module, plan: Plan, options: RunOptions) -> Collectives:
    """The run's collectives (``collectives_for`` its layout), once every rank holds the same run."""
    comm = collectives_for(plan.parallel.world_size)
    if comm.world_size > 1:
        try:
            check_ranks_agree(model, plan, options)
        except BaseException:
            comm.close()  # its heartbeat: the run ends here
            raise
    return comm
