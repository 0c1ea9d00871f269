"""Choosing a pipelined layout's schedule, segment count and micro-batches for a profiled model: each
candidate's step predicted by FOLD3D's model (``planner.fold3d``) from the profile's block times, the
data-parallel network between a stage's replicas and the link between a pipeline's stages.

A stage's compute is its blocks' forward and backward at the profiled batch (M micro-batches of a
batch take about the batch's time), the rest's (embeddings, head) on the last stage; its DP.sync is
its blocks' fp32 gradients all-reduced over its replicas; one segment's PP.sync is the hidden states
sent on and their gradients sent back, for every micro-batch. The stash is the activation checkpoints
(each a micro-batch's hidden state) the first stage holds at its peak (eqs. 6-7): AIAO's wait in host
memory, the other schedules' on the device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tiertrain.plan.pipeline import SCHEDULES, PipelineLayout, fold
from tiertrain.planner.fold3d import StageTimes, aiao_s, one_f_one_b_s, stash_checkpoints
from tiertrain.planner.network import Network
from tiertrain.planner.profile import BlockProfile, Profile

GRAD_BYTES = 4  # fp32 gradients, as data parallel reduces them


@dataclass(frozen=True)
class PipelineChoice:
    layout: PipelineLayout
    times: StageTimes
    step_s: float
    stash: int          # activation checkpoints the first stage holds at its peak
    stash_bytes: int    # their bytes (on the host for AIAO, on the device otherwise)
    params: int         # parameters of the rank holding the most

    def why(self) -> str:
        t, ns = self.times, self.layout.segments
        share = t.dp_sync_s / t.compute_s if t.compute_s else 0.0
        hidden = (f"{(ns - 1) / ns:.0%} of it under the other segments' compute ({t.split(ns):.0%} of a segment's "
                  "under the backward before it, Alg. 2's r; the rest under the next forward)"
                  if self.layout.schedule == "aiao" else "after the last backward")
        return (f"DP.sync {t.dp_sync_s:.3f} s ({share:.0%} of a stage's compute {t.compute_s:.3f} s), {hidden}; "
                f"bubble {t.bubble_s(ns):.3f} s ((p-1)/({ns} x {t.micro_batches}) of the compute)")


def stage_times(p: Profile, layout: PipelineLayout, dp_net: Network, pp_bps: float) -> tuple[StageTimes, int]:
    """FOLD3D's inputs for ``layout`` (the busiest rank's), and that rank's parameter count."""
    runs = fold(len(p.blocks), layout.pp, layout.segments)
    compute, backward, params = [0.0] * layout.pp, [0.0] * layout.pp, [0] * layout.pp
    for v, run in enumerate(runs):
        r, ends = v % layout.pp, ends_s(p, v, len(runs))
        compute[r] += sum(p.blocks[i].forward_s + p.blocks[i].backward_s for i in run) + 2 * ends
        backward[r] += sum(p.blocks[i].backward_s for i in run) + ends
        params[r] += sum(p.blocks[i].params for i in run)
    compute[-1] += p.rest.forward_s + p.rest.backward_s
    backward[-1] += p.rest.backward_s
    params[-1] += p.rest.params
    busiest = max(range(layout.pp), key=lambda r: (compute[r], params[r]))
    dp_s = dp_net.reduce_s(GRAD_BYTES * params[busiest], False) if dp_net.parallel else 0.0
    hidden = max(b.hidden_bytes for b in p.blocks)  # one segment's hop: every micro-batch's, there and back
    pp_s = 2 * hidden / pp_bps if layout.pp > 1 else 0.0
    return StageTimes(compute[busiest], dp_s, pp_s, layout.pp, layout.micro_batches,
                      backward_s=backward[busiest]), params[busiest]


def ends_s(p: Profile, v: int, stages: int) -> float:
    """The seconds each way virtual stage ``v`` of ``stages`` spends gathering the whole sequence at its ends
    under sequence parallel (``planner.tensor.with_stage_ends``): its input where it is not the first, its
    output where it is not the last."""
    return p.gather_in_s * (v > 0) + p.gather_out_s * (v < stages - 1)


def step_s(t: StageTimes, layout: PipelineLayout) -> float:
    """The predicted step: AIAO's eq. (2), or eq. (1) for GPipe, 1F1B and interleaved 1F1B (whose DP.sync
    follows the flush)."""
    return aiao_s(t, layout.segments) if layout.schedule == "aiao" else one_f_one_b_s(t, layout.segments)


def candidates(n_blocks: int, pp: int, rows: int) -> list[PipelineLayout]:
    """Every layout a run of ``rows`` sequences per replica could take: each schedule, its segment counts
    (one for GPipe and 1F1B), every micro-batch count dividing the rows."""
    out = []
    for schedule in SCHEDULES:
        counts = range(1, n_blocks // pp + 1) if schedule in ("aiao", "interleaved") else (1,)
        for ns in counts:
            for m in (m for m in range(1, rows + 1) if rows % m == 0):
                layout = PipelineLayout(pp, schedule, m, ns)
                runs = schedule != "interleaved" or (ns > 1 and m % pp == 0)
                if runs and (schedule != "1f1b" or m >= pp) and pp * ns <= n_blocks:
                    out.append(layout)
    return out


def choose_pipeline(p: Profile, pp: int, dp_net: Network, pp_bps: float, rows: int) -> list[PipelineChoice]:
    """Every candidate layout predicted, fastest first (a smaller stash first among equals)."""
    out = [predict(p, layout, dp_net, pp_bps, rows) for layout in candidates(len(p.blocks), pp, rows)]
    return sorted(out, key=lambda c: (round(c.step_s, 9), c.stash_bytes))


def predict(p: Profile, layout: PipelineLayout, dp_net: Network, pp_bps: float, rows: int) -> PipelineChoice:
    """``layout``'s step by FOLD3D's model, and its stash, for a step of ``rows`` sequences per replica."""
    hidden_row = max(b.hidden_bytes for b in p.blocks) // rows  # a micro-batch's checkpoint is its rows' share
    t, params = stage_times(p, layout, dp_net, pp_bps)
    stash = stash_checkpoints(layout.schedule, layout.pp, layout.segments, layout.micro_batches)
    return PipelineChoice(layout, t, step_s(t, layout), stash, stash * hidden_row * (rows // layout.micro_batches),
                          params)


def for_stage(p: Profile, layout: PipelineLayout, n_blocks: int) -> Profile:
    """The profile a rank plans one of its stages by: its first ``n_blocks`` blocks (a rank's largest stage),
    each activation at a micro-batch's rows (the profile's are the batch's; M micro-batches split it), as
    many micro-batches' saved activations held at once as the schedule keeps in flight on a stage (the first
    stage's eqs. 6-7 count over its segments), the pipeline's prefetch of the next micro-batch's offloaded
    ones, each micro-batch's stash moved (its copies' time M of one micro-batch's), and its worst stage's
    gathers at its ends under sequence parallel (``ends_s``) on its first block."""
    m = layout.micro_batches
    in_flight = math.ceil(stash_checkpoints(layout.schedule, layout.pp, layout.segments, m) / layout.segments)
    stages = layout.pp * layout.segments
    ends = max(ends_s(p, v, stages) for v in range(stages))  # the stage with the most, on its first block
    blocks = [_micro(b, m) for b in p.blocks[:n_blocks]]
    blocks[0] = dataclasses.replace(blocks[0], forward_s=blocks[0].forward_s + ends,
                                    backward_s=blocks[0].backward_s + ends)
    return dataclasses.replace(p, blocks=tuple(blocks), rest=_micro(p.rest, m), gather_in_s=0.0, gather_out_s=0.0,
                               micro_in_flight=max(1, min(m, in_flight)), stash_ahead=True, micro_batches=m)


def _micro(b: BlockProfile, m: int) -> BlockProfile:
    """``b`` with one micro-batch's activations (of ``m``); its times stay the step's."""
    return dataclasses.replace(b, act_bytes=-(-b.act_bytes // m), hidden_bytes=-(-b.hidden_bytes // m))
