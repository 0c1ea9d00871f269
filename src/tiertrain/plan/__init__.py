"""The plan layer: what a step does, as plain data. Imports no torch and nothing of the memory
layer's machinery, so the planner can be run, tested and benchmarked from a profile file alone.

``tiers``: where bytes live and what they are (Tier, Kind). ``plan``: the Plan and its blocks'
switches. ``parallel``: the process layout. ``budgets``: what the user allows each tier.
``options``: the training loop's settings a run is set up with. ``bytes``: where each chunk lives. ``fit``: what a plan holds per tier and
whether it fits, the one accounting setup, the runtime and the planner share, and ``resolve``, which
writes a run's derived decisions into its plan. ``update_modes``: what the modes mean, as data.
"""

from tiertrain.plan.budgets import Budgets
from tiertrain.plan.options import RunOptions
from tiertrain.plan.parallel import ParallelLayout
from tiertrain.plan.plan import (BUILTIN_PLANS, COMPUTE_DTYPES, DEFAULT_MAX_STALENESS, BlockPlan, Plan, Resolved,
                                 builtin_plan, data_parallel, load_plan)
from tiertrain.plan.update_modes import UPDATE_MODES, check_update_mode
from tiertrain.plan.tiers import Kind, Tier

__all__ = ["BUILTIN_PLANS", "Budgets", "COMPUTE_DTYPES", "DEFAULT_MAX_STALENESS", "UPDATE_MODES", "BlockPlan", "Kind",
           "ParallelLayout", "Plan", "Resolved", "RunOptions", "Tier", "builtin_plan", "check_update_mode", "data_parallel", "load_plan"]
