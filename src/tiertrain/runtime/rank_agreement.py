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


def model_signature(model: nn.Module) -> str:
    """A short hash of the model's parameters' names, shapes and dtypes."""
    shapes = "\n".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha256(shapes.encode()).hexdigest()[:16]


def run_fields(model: nn.Module, plan: Plan, options: RunOptions) -> dict[str, str]:
    """The fields compared, each as text: the model's signature (its parameters' names, shapes and
    dtypes), the options a step's collectives depend on, and the plan field by field (its name aside;
    of what resolving decided, how gradients are held: the pool's count follows each rank's budgets)."""
    fields = {"the model (its parameters' names, shapes and dtypes)": model_signature(model),
              "gradient accumulation": str(options.grad_accum), "clipping": str(options.max_grad_norm),
              "training": str(options.train), "update mode": plan.update, "precision": plan.compute_dtype}
    laid_out = json.loads(plan.to_json())
    for key in ("name", "resolved", "update", "compute_dtype", "beside_pool", "stash"):
        laid_out.pop(key, None)
    fields |= {f"the plan's {key}": json.dumps(value, sort_keys=True) for key, value in laid_out.items()}
    fields["how the plan holds gradients"] = plan.resolved.grads if plan.resolved is not None else "unresolved"
    fields["when gradients are reduced over the ranks"] = plan.reduce_every
    return fields


def check_ranks_agree(model: nn.Module, plan: Plan, options: RunOptions, ranks: list[int] | None = None) -> None:
    same_on_every_rank("the run's settings", run_fields(model, plan, options), FIX, ranks)


def agreed_collectives(model: nn.Module, plan: Plan, options: RunOptions, comm: Collectives | None = None
                       ) -> Collectives:
    """The run's collectives, once every rank of them holds the same run: ``comm`` where the caller made
    them (a pipeline stage's data-parallel group, whose ranks alone compare), else ``collectives_for``
    the plan's layout (every rank of the run)."""
    if comm is not None and comm.world_size != plan.parallel.world_size:
        raise ValueError(f"internal: a plan for {plan.parallel.world_size} ranks over a group of {comm.world_size}")
    comm = comm or collectives_for(plan.parallel.world_size)
    if comm.world_size > 1:
        try:
            check_ranks_agree(model, plan, options, getattr(comm, "ranks", None))
        except BaseException:
            comm.close()  # its heartbeat: the run ends here
            raise
    return comm
