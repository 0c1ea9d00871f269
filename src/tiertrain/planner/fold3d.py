"""FOLD3D's performance model of a pipelined, data-parallel step (``../shared/papers/002_*`` §3.3,
eqs. 1-7) and the choices AIAO makes from it: the split ratio of each segment's DP.sync (Alg. 2) and the
segment count (§4's heuristic).

The inputs are one pipeline stage's, per step: its compute (every micro-batch's forward and backward),
its data-parallel gradient sync, its point-to-point sends for one segment, and what never overlaps
(tensor parallel's syncs). A schedule's step is then:

  1F1B (eq. 1):   compute + DP.sync + PP.sync/M + bubble, bubble = (p-1) compute / M
  interleaved:    the same with v virtual stages per rank: bubble = (p-1) compute / (v M)
  AIAO (eq. 2):   max(compute, overlapped) + not overlapped + bubble, bubble (eq. 3) = (p-1) compute / (ns M)
                  overlapped = (M-1)/M PP.sync + (ns-1)/ns DP.sync; not overlapped (eq. 5) = PP.sync/M +
                  DP.sync/ns + TP.sync; with ns segments PP.sync is ns times one segment's (each fold is a hop)

Eq. (4) as printed subtracts the compute from the overlapped communication; read inside eq. (2)'s max
that would count the compute twice, so ``overlapped`` here is the communication that can hide under
compute, and the max takes the longer of the two. Memory (per stage, activation checkpoints stashed):
interleaved 1F1B (eq. 6) (p (ns + 1) - 1) checkpoints, AIAO (eq. 7) M ns, which AIAO keeps in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiertrain.typed import at_least

_TIME = at_least(0.0)


@dataclass(frozen=True)
class StageTimes:
    compute_s: float = field(metadata=_TIME)  # T^comp: every micro-batch's forward and backward on one stage
    dp_sync_s: float = field(metadata=_TIME)  # T_dp^comm: the stage's gradients synced over its dp replicas
    pp_sync_s: float = field(metadata=_TIME)  # one segment's activations and their gradients sent on, all M
    stages: int = field(metadata=at_least(1))          # p
    micro_batches: int = field(metadata=at_least(1))   # M (FOLD3D's ms)
    other_s: float = field(default=0.0, metadata=_TIME)  # T_ip^comm: what never overlaps (tensor parallel's syncs)
    backward_s: float = field(default=0.0, metadata=_TIME)  # the backward passes' part of compute_s (Alg. 2's r)

    def split(self, segments: int) -> float:
        """Alg. 2's r for ``segments``: the part of a segment's DP.sync hidden under one segment's backward."""
        return split_ratio(self.backward_s / segments, self.dp_sync_s / segments)

    def bubble_s(self, virtual: int = 1) -> float:
        """Eq. (3): the pipeline's fill and drain, p - 1 forward and backward passes of one micro-batch of
        one (virtual) stage."""
        return (self.stages - 1) * self.compute_s / (virtual * self.micro_batches)


def one_f_one_b_s(t: StageTimes, virtual: int = 1) -> float:
    """Eq. (1): Megatron's 1F1B (``virtual`` > 1: interleaved), whose DP.sync follows the flush."""
    pp = virtual * t.pp_sync_s / t.micro_batches  # the first micro-batch's hops are exposed
    return t.compute_s + t.dp_sync_s + pp + t.other_s + t.bubble_s(virtual)


def overlapped_s(t: StageTimes, segments: int) -> float:
    """Eq. (4), the communication that can run under compute: all but the first micro-batch's sends, and
    the DP.sync of all but the first segment."""
    m = t.micro_batches
    return (m - 1) / m * segments * t.pp_sync_s + (segments - 1) / segments * t.dp_sync_s


def exposed_s(t: StageTimes, segments: int) -> float:
    """Eq. (5), the communication on the critical path: the first micro-batch's sends, the first segment's
    DP.sync (the next forward waits for its update), and what never overlaps."""
    return segments * t.pp_sync_s / t.micro_batches + t.dp_sync_s / segments + t.other_s


def aiao_s(t: StageTimes, segments: int) -> float:
    """Eq. (2): AIAO's step with ``segments`` (ns) segments."""
    return max(t.compute_s, overlapped_s(t, segments)) + exposed_s(t, segments) + t.bubble_s(segments)


def split_ratio(backward_s: float, dp_sync_s: float) -> float:
    """Alg. 2's r: the part of a segment's DP.sync hidden under the backward of the segment before it (one
    segment's each, ``backward_s``, against one segment's sync, ``dp_sync_s``); the rest lands under the
    next step's forward of the segments before it. FOLD3D launches that rest only then (its communicator
    runs one collective at a time, and the backward's sends must not queue behind it); tiertrain issues a
    segment's whole DP.sync as its backward ends, on a group of its own, and each block lands it at its
    next use (``runtime.backward.BackwardPass.hand_over``), so r here says where it lands, not when it starts."""
    return 1.0 if dp_sync_s <= backward_s else backward_s / dp_sync_s


def segments_for(t: StageTimes, most: int) -> int:
    """§4: ns raised from 1 while the communication it overlaps (the DP.sync it moves off the critical
    path, and the sends each fold adds) still fits under the compute, up to ``most`` (the blocks a
    stage holds)."""
    ns = 1
    while ns < most and overlapped_s(t, ns + 1) <= t.compute_s:
        ns += 1
    return ns


def stash_checkpoints(schedule: str, stages: int, segments: int, micro_batches: int) -> int:
    """Activation checkpoints the first stage holds at its peak: eq. (6) for interleaved 1F1B, eq. (7) for
    AIAO (every micro-batch of every segment: host memory, in tiertrain), GPipe every micro-batch's, 1F1B
    one per stage in flight."""
    if schedule == "aiao":
        return micro_batches * segments
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(stages, micro_batches)
    return stages * (segments + 1) - 1
