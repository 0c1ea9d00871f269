"""Which blocks' states forward reads in from disk ahead of their updates: one rule for the runtime
(``Runtime._read_during_forward``) and the simulator (``planner.updates``), so what is predicted is
what runs.

Backward reaches the last block first and, where updates follow backward (overlap without clipping),
updates blocks in that order. Forward reads the first ``read_ahead`` disk-homed blocks backward reaches
(the read-ahead places), and, once no update or write-back runs, the next ``2 * update_workers`` (the
update workers' places, idle through forward: ``plan.bytes.tier_bytes`` counts both). Always a prefix
of that order: a block further on would hold a place through the backward of every block before it,
and the host could then need more places than it has once a worker takes a block not read in. For
the same reason the workers' places are used only where each block read is updated in that order
(``Runtime._updates_follow_backward``: not one whose gradients flush only as backward ends).
Blocks updated in pieces stage their own states and are not read ahead; the rest has no backward hook.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiertrain.plan.bytes import in_pieces
from tiertrain.plan.plan import Plan
from tiertrain.plan.tiers import Tier


@dataclass(frozen=True)
class ForwardReads:
    first: tuple[int, ...]       # block indices read from forward's start, in backward order
    while_idle: tuple[int, ...]  # then these, where updates follow backward and none runs


def forward_reads(plan: Plan) -> ForwardReads:
    """Nothing where ``read_ahead`` is 0: no block is read ahead at all."""
    if not plan.read_ahead:
        return ForwardReads((), ())
    order = [i for i in range(len(plan.blocks) - 1, -1, -1)
             if plan.blocks[i].home is Tier.DISK and not in_pieces(plan.blocks[i])]
    ahead, workers = plan.read_ahead, 2 * plan.update_workers
    return ForwardReads(tuple(order[:ahead]), tuple(order[ahead: ahead + workers]))
