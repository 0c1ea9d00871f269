"""FOLD3D's AIAO schedule (§3.2 steps 2-3, Alg. 1) as an action list for torch's pipelining runtime
(``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``), so the stages, their send/recv and
the loss are torch's, and only the order is ours.

On each rank: every micro-batch's forward of its first segment, then of the next, to the last (the
model folded onto the ranks: ``plan.pipeline.fold``); then the backward of the last segment for every
micro-batch, and the moment it ends the segment's DP.sync is issued (``REDUCE_GRAD``, a custom function
of the runtime: it starts the segment's gradient reduction asynchronously and returns), so it runs
under the backward of the segments before it; and so on down to the first. Torch's ``ScheduleLoopedBFS``
has the same compute order; AIAO is that order with a reduction per segment at the end of its
backward, and each segment's update landing before its next forward (Alg. 1 line 4). Why not
``ScheduleLoopedBFS`` itself: its gradient reduction runs once per step after every backward (its
``REDUCE_GRAD`` for every stage comes at the end), which is the serialized DP.sync AIAO removes.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import _Action, _ComputationType

FORWARD = _ComputationType.FORWARD
BACKWARD = _ComputationType.FULL_BACKWARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD


def aiao_order(rank: int, pp: int, segments: int, micro_batches: int) -> list[_Action]:
    """One rank's compute actions, and each segment's DP.sync right after its last backward."""
    stages = [seg * pp + rank for seg in range(segments)]
    actions = [_Action(v, FORWARD, mb) for v in stages for mb in range(micro_batches)]
    for v in reversed(stages):
        actions += [_Action(v, BACKWARD, mb) for mb in range(micro_batches)]
        actions.append(_Action(v, REDUCE_GRAD, None))
    return actions


def aiao_orders(pp: int, segments: int, micro_batches: int) -> dict[int, list[_Action]]:
    """Every rank's (each rank computes all of them, as torch's schedules do)."""
    return {rank: aiao_order(rank, pp, segments, micro_batches) for rank in range(pp)}
