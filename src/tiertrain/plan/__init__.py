"""The plan layer: what a step does, as plain data. Imports no torch and nothing of the memory
layer's machinery, so the planner can be run, tested and benchmarked from a profile file alone.

``tiers``: where bytes live and what they are (Tier, Kind). ``plan``: the Plan and its blocks'
switches. ``parallel``: the process layout. ``budgets``: what the user allows each tier. ``options``: the training loop's settings a run is
set up with. ``bytes``: what a plan holds per tier, the one accounting the runtime's budget
check and the planner share.
"""

from tiertrain.plan.budgets import Budgets
from tiertrain.plan.options import RunOptions
from tiertrain.plan.parallel import ParallelLayout
from tiertrain.plan.plan import (BUILTIN_PLANS, COMPUTE_DTYPES, DEFAULT_MAX_STALENESS, UPDATE_MODES, BlockPlan, Plan,
                                 builtin_plan, check_update_mode, data_parallel, load_plan)
from tiertrain.plan.tiers import Kind, Tier

__all__ = ["BUILTIN_PLANS", "Budgets", "COMPUTE_DTYPES", "DEFAULT_MAX_STALENESS", "UPDATE_MODES", "BlockPlan", "Kind",
           "ParallelLayout", "Plan", "RunOptions", "Tier", "builtin_plan", "check_update_mode", "data_parallel", "load_plan"]
