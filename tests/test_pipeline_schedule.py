"""Pipeline parallel as data (issue 38, first part): FOLD3D's fold of the blocks onto the stages, the
layout's refusals, AIAO's action list (checked by torch's own schedule simulator and validator), and
FOLD3D's performance model (eqs. 1-7), split ratio and segment count. The runtime that executes the
schedule over tiered stages is not built yet."""

import pytest
from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _simulate_comms_compute, _validate_schedule

from tiertrain.errors import ConfigError
from tiertrain.parallel.aiao import BACKWARD, FORWARD, REDUCE_GRAD, aiao_order, aiao_orders
from tiertrain.plan.pipeline import PipelineLayout, fold, rank_of
from tiertrain.planner.fold3d import (StageTimes, aiao_s, exposed_s, one_f_one_b_s, segments_for, split_ratio,
                                      stash_checkpoints)


def test_the_model_is_folded_as_fold3ds_example_and_unevenly_where_it_must():
    """12 layers A..L, ns = 2, p = 3: rank 0 holds (A, B) and (G, H), rank 1 (C, D) and (I, J), rank 2
    (E, F) and (K, L) (FOLD3D §3.2 step 1)."""
    stages = fold(12, 3, 2)
    held = {r: [list(stages[v]) for v in range(len(stages)) if rank_of(v, 3) == r] for r in range(3)}
    assert held == {0: [[0, 1], [6, 7]], 1: [[2, 3], [8, 9]], 2: [[4, 5], [10, 11]]}
    assert [len(s) for s in fold(10, 2, 2)] == [3, 3, 2, 2]
    assert [b for s in fold(7, 3, 1) for b in s] == list(range(7))


@pytest.mark.parametrize("layout, world, blocks, batch, says", [
    (PipelineLayout(pp=3), 4, 12, 8, "--pp 3 does not divide the 4 ranks; choose --pp among 1, 2, 4"),
    (PipelineLayout(pp=2, segments=3), 4, 5, 8, "6 pipeline stages (2 ranks x 3 segments) for a model of 5 blocks"),
    (PipelineLayout(pp=2, schedule="interleaved", micro_batches=3, segments=2), 2, 8, 6, "not a multiple of 2"),
    (PipelineLayout(pp=2, micro_batches=3), 2, 8, 8, "a batch of 8 sequences does not split into 3 micro-batches"),
    (PipelineLayout(pp=2, schedule="1f1b", segments=2), 2, 8, 8, "the 1f1b schedule holds one stage per rank"),
    (PipelineLayout(pp=4, schedule="1f1b", micro_batches=2), 4, 8, 8, "give --micro-batches 4 or more"),
])
def test_a_layout_no_rank_could_run_is_refused_in_one_line_naming_the_fix(layout, world, blocks, batch, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        layout.check(world, blocks, batch)
    PipelineLayout(pp=2, schedule="aiao", micro_batches=4, segments=2).check(4, 8, 8)  # one that runs


def test_aiao_runs_each_segments_micro_batches_together_and_syncs_a_segment_as_its_backward_ends():
    """Forward: every micro-batch of segment 1, then of segment 2; backward: the last segment first, and
    its DP.sync (REDUCE_GRAD) issued before the backward of the segment before it starts (FOLD3D Alg. 1-2:
    it runs under that backward)."""
    order = aiao_order(rank=1, pp=3, segments=2, micro_batches=9)
    kinds = [(a.computation_type, a.stage_index) for a in order]
    assert kinds[:18] == [(FORWARD, 1)] * 9 + [(FORWARD, 4)] * 9
    assert kinds[18:] == [(BACKWARD, 4)] * 9 + [(REDUCE_GRAD, 4)] + [(BACKWARD, 1)] * 9 + [(REDUCE_GRAD, 1)]
    assert [a.microbatch_index for a in order[:9]] == list(range(9))
    assert order.index(_Action(4, REDUCE_GRAD, None)) < order.index(_Action(1, BACKWARD, 0))


@pytest.mark.parametrize("pp, segments, micro", [(2, 1, 4), (2, 2, 3), (3, 2, 9), (4, 3, 8)])
def test_torchs_pipelining_runtime_can_run_the_aiao_order_without_deadlock(pp, segments, micro):
    """Torch's validator accepts every rank's order, and its dry run of the order with the sends and
    receives it inserts (``_add_send_recv``) completes on every rank (a cycle would stop it: "Schedule is
    not progressing"). With one segment AIAO is GPipe: every forward, then every backward."""
    orders = aiao_orders(pp, segments, micro)
    _validate_schedule(aiao_orders(pp, segments, micro), pp, pp * segments, micro)
    with_comms = _add_send_recv(orders, lambda v: rank_of(v, pp), pp * segments)
    compute_and_comms = {r: [a for a in acts if a.computation_type != REDUCE_GRAD] for r, acts in with_comms.items()}
    done = _simulate_comms_compute(compute_and_comms, lambda v: rank_of(v, pp), pp * segments)
    assert all(sum(a is not None for a in done[r]) == len(compute_and_comms[r]) for r in range(pp))
    if segments == 1:
        kinds = [a.computation_type for a in aiao_order(0, pp, 1, micro) if a.computation_type != REDUCE_GRAD]
        assert kinds == [FORWARD] * micro + [BACKWARD] * micro


def test_fold3ds_model_predicts_the_exposed_dp_sync_and_the_step_of_each_schedule():
    """One stage: 1 s of compute a step, DP.sync 0.5 s, a segment's sends 0.04 s, p = 4, M = 8. 1F1B: compute +
    DP.sync + the first micro-batch's sends + a bubble of 3/8 (eq. 1). AIAO with 2 segments: half the
    DP.sync and 7/8 of the sends under compute (eq. 4), the other half and one micro-batch's sends
    exposed (eq. 5), a bubble of 3/16 (eq. 3)."""
    t = StageTimes(compute_s=1.0, dp_sync_s=0.5, pp_sync_s=0.04, stages=4, micro_batches=8)
    assert one_f_one_b_s(t) == pytest.approx(1.0 + 0.5 + 0.005 + 0.375)
    assert exposed_s(t, 2) == pytest.approx(0.01 + 0.25)
    assert aiao_s(t, 2) == pytest.approx(1.0 + 0.26 + 0.1875)
    assert one_f_one_b_s(t, virtual=2) == pytest.approx(1.0 + 0.5 + 0.01 + 0.1875)  # interleaved: the bubble halves
    assert aiao_s(t, 1) == pytest.approx(1.0 + 0.5 + 0.005 + 0.375)  # one segment: GPipe, DP.sync after the flush


def test_the_segment_count_grows_while_what_it_overlaps_fits_under_compute_and_meets_fold3ds_claims():
    """Where DP.sync is a quarter of the 1F1B step (FOLD3D's targets: at least 60% less exposed DP.sync,
    and a faster step), ns grows until the overlapped communication would pass the compute; where
    DP.sync alone is longer than the compute, folding hides nothing and ns stays 1."""
    t = StageTimes(compute_s=1.0, dp_sync_s=0.5, pp_sync_s=0.01, stages=4, micro_batches=8)
    assert t.dp_sync_s >= 0.25 * one_f_one_b_s(t)
    ns = segments_for(t, most=8)
    assert ns == 8 and t.dp_sync_s / ns <= 0.4 * t.dp_sync_s and one_f_one_b_s(t) / aiao_s(t, ns) >= 1.2
    heavy = StageTimes(compute_s=1.0, dp_sync_s=2.5, pp_sync_s=0.01, stages=4, micro_batches=8)
    assert segments_for(heavy, most=8) == 1
    middle = StageTimes(compute_s=1.0, dp_sync_s=1.2, pp_sync_s=0.01, stages=4, micro_batches=8)
    ns = segments_for(middle, most=8)
    assert 1 < ns < 8 and (ns - 1) / ns * 1.2 + 7 / 8 * ns * 0.01 <= 1.0 < ns / (ns + 1) * 1.2 + 7 / 8 * (ns + 1) * 0.01


def test_the_split_ratio_and_the_stashed_checkpoints_follow_alg_2_and_eqs_6_7():
    assert split_ratio(backward_s=0.3, dp_sync_s=0.2) == 1.0  # all of it hides under the next backward
    assert split_ratio(backward_s=0.3, dp_sync_s=0.6) == pytest.approx(0.5)  # half waits for the next forward
    assert stash_checkpoints("aiao", 4, 2, 8) == 16 and stash_checkpoints("interleaved", 4, 2, 8) == 11
    assert stash_checkpoints("1f1b", 4, 1, 8) == 4 and stash_checkpoints("gpipe", 4, 1, 8) == 8
    assert [stash_checkpoints("aiao", 2, 2, m) for m in (4, 16)] == [8, 32]  # grows with M: why AIAO stashes on the host


def _profile(blocks: int = 8, fwd: float = 0.01, params: int = 1_000_000, hidden: int = 1 << 20):
    from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile

    block = BlockProfile("b", fwd, 2 * fwd, params, 4 * hidden, hidden)
    m = MachineProfile(h2d_bps=10e9, d2h_bps=10e9, disk_read_bps=1e9, disk_write_bps=1e9, adam_params_per_s=1e9)
    return Profile(tuple(block for _ in range(blocks)), BlockProfile("rest", 0.0, 0.0, 0, 0, 0), m)


def test_a_layouts_predicted_step_is_fold3ds_model_of_its_busiest_stage():
    """Two segments of 8 blocks over 2 ranks: a rank holds 4 blocks (forward 10 ms, backward 20 ms each),
    their 4 M parameters' fp32 gradients all-reduced over 2 replicas at 1 GB/s (2 x 8 MB = 16 ms), and each
    hop sends the batch's hidden states and their gradients (2 MiB at 1 GB/s)."""
    from tiertrain.planner.network import Network
    from tiertrain.planner.pipeline import stage_times, step_s

    layout = PipelineLayout(pp=2, schedule="aiao", micro_batches=4, segments=2)
    t, params = stage_times(_profile(), layout, Network.from_link(2, 1e9, "test"), 1e9)
    assert params == 4_000_000 and t.compute_s == pytest.approx(4 * 0.03) and t.backward_s == pytest.approx(4 * 0.02)
    assert t.dp_sync_s == pytest.approx(2 * 16e6 / 2 / 1e9) and t.pp_sync_s == pytest.approx(2 * (1 << 20) / 1e9)
    assert step_s(t, layout) == aiao_s(t, 2)
    one = PipelineLayout(pp=2, schedule="1f1b", micro_batches=4)
    t1, _ = stage_times(_profile(), one, Network.from_link(2, 1e9, "test"), 1e9)
    assert step_s(t1, one) == one_f_one_b_s(t1) and t1.dp_sync_s == t.dp_sync_s


def test_aiao_with_segments_is_chosen_where_dp_sync_is_large_and_1f1b_never_beats_it_without_one():
    """Where the replicas' link is slow, AIAO hides all but 1/ns of DP.sync and is chosen with several
    segments and many micro-batches; with one replica (no DP.sync) the bubble decides, and the stash of
    the chosen layout is what eqs. 6-7 count."""
    from tiertrain.planner.network import Network
    from tiertrain.planner.pipeline import candidates, choose_pipeline

    slow = choose_pipeline(_profile(), 2, Network.from_link(2, 1e8, "slow"), 1e10, rows=8)
    best = slow[0]
    assert best.layout.schedule == "aiao" and best.layout.segments > 1, best
    one_f = min(c.step_s for c in slow if c.layout.schedule == "1f1b")
    ns, r = best.layout.segments, best.times.split(best.layout.segments)
    assert r == split_ratio(best.times.backward_s / ns, best.times.dp_sync_s / ns) < 1  # the slow link: part waits
    assert best.step_s < one_f and f"{r:.0%} of a segment's under the backward before it, Alg. 2's r" in best.why()
    assert best.stash == best.layout.micro_batches * best.layout.segments
    alone = choose_pipeline(_profile(), 2, Network.from_link(1, 1e9, "none"), 1e10, rows=8)
    assert all(c.times.dp_sync_s == 0 for c in alone)
    assert alone[0].step_s <= min(c.step_s for c in alone if c.layout.schedule == "1f1b")
    for layout in candidates(8, 2, 8):
        layout.check(4, 8, 8)  # every candidate is one a rank would run
    assert not any(c.schedule == "interleaved" and c.micro_batches % 2 for c in candidates(8, 2, 6))


def test_a_stage_takes_its_blocks_plans_from_a_whole_models_plan_or_a_stages():
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.plan import BlockPlan, Plan
    from tiertrain.plan.pipeline import stage_plan

    whole = Plan(tuple(BlockPlan(home=Tier.DISK if i % 2 else Tier.HOST, stream=True) for i in range(8)),
                 BlockPlan(home=Tier.HOST))
    cut = stage_plan(whole, range(4, 7), 8, 3)
    assert cut.blocks == whole.blocks[4:7] and cut.rest == whole.rest
    stage = dataclasses.replace(whole, blocks=whole.blocks[:3])  # `plan --pp`'s: the largest stage's blocks
    assert stage_plan(stage, range(6, 8), 8, 3).blocks == whole.blocks[:2]
    for wrong in (2, 4):  # a stage's plan of another length, or a whole model's of another depth
        with pytest.raises(ConfigError, match="make it for the model's 8, or for a stage's 3"):
            stage_plan(dataclasses.replace(whole, blocks=whole.blocks[:wrong]), range(0, 3), 8, 3)


def test_a_stage_names_its_parameters_and_blocks_as_the_model_does():
    """A stage's parameter names (its state dict's keys, its checkpoint's entries) and its blocks' names are
    the whole model's: the stages of a pipeline together name every parameter once."""
    from tiertrain.models import build
    from tiertrain.models.gpt_stages import stage_of
    from tiertrain.runtime.blocks import find_blocks

    model = build({"n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256, "max_seq_len": 64,
                   "tie_embeddings": False})
    names = dict(model.named_parameters())
    stages = [stage_of(model, run) for run in fold(4, 2, 1)]
    got = [n for s in stages for n, p in s.named_parameters() if names[n] is p]
    assert sorted(got) == sorted(names)
    assert [b.name for b in find_blocks(stages[1])] == ["blocks.2", "blocks.3", "rest"]
    assert stages[1].blocks[0] is model.blocks[2] and len(stages[1].blocks) == 2
