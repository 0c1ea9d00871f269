"""Whether a plan runs its blocks over several device streams (STRONGHOLD's multi-stream execution,
``runtime.streams``): the profiler measures each block's forward and backward with its batch over n
streams (``BlockProfile.stream_ratio``, on a GPU), the simulator replays a plan with each block's times
at its plan's count, and the planner keeps streams only where the replayed step gains at least ``GAIN``
over one stream. Nothing else changes with the count: the chunks share the block's one copy of its
parameters, and autograd keeps the same activations whichever stream made them.
"""

from __future__ import annotations

import dataclasses

from tiertrain.plan import Plan
from tiertrain.planner.profile import BlockProfile, Profile

GAIN = 0.05  # below this the gain is within a step's noise on the machines measured so far


def ratio(b: BlockProfile, n: int) -> float:
    """The block's time over ``n`` streams as a fraction of one stream's (1 where not measured)."""
    return dict(b.stream_ratio).get(n, 1.0) if n > 1 else 1.0


def at_streams(p: Profile, plan: Plan) -> Profile:
    """``p`` with each block's forward, backward and recompute at the count its plan gives it."""
    if all(bp.streams == 1 for bp in plan.blocks):
        return p
    return dataclasses.replace(p, blocks=tuple(b.computing(ratio(b, bp.streams)) for b, bp in zip(p.blocks, plan.blocks)))


def measured_counts(p: Profile) -> list[int]:
    """The stream counts measured for every block."""
    counts = [set(dict(b.stream_ratio)) for b in p.blocks]
    return sorted(set.intersection(*counts)) if counts else []


def with_streams(plan: Plan, n: int) -> Plan:
    """Every block of ``plan`` over ``n`` streams."""
    return dataclasses.replace(plan, blocks=tuple(dataclasses.replace(b, streams=n) for b in plan.blocks))
