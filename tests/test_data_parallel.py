"""Data parallel over gloo ranks (issue 19): sharded (ZeRO-2/3-like) and replicated (DDP-like) block
groups train as torch's DistributedDataParallel does, bit for bit at dp = 2 in fp32 (a sum of two is
the same in any order, and halving is exact), with accumulation; with clipping and at dp = 4 within
a stated tolerance; each rank sends the bytes the layouts' formulas say."""

import dataclasses
import functools

import pytest

from dp_harness import (TINY4, agreed_auto_setup, delayed_ddp_losses, slow_publish_losses, loaded_after_a_step, agreed_budgets, ddp_losses, failure_on_rank0, gather_events,
                        mismatched_collective, mismatched_setup, one_process_checkpoint, per_micro_losses, pool_peaks,
                        recheck_on_rank0, reduction_events, resumed_by_parts, run_ranks, run_ranks_one_dies,
                        saved_then_uninterrupted, sent_per_step, tiered_losses, unshared_save, disk_reads_by_thread,
                        backward_twice, raised_then_trained)
from tiertrain.memory import Tier
from tiertrain.parallel import ring_bytes
from tiertrain.plan import BlockPlan, Plan, builtin_plan, data_parallel

N = TINY4["n_layer"]
DISK = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in range(N)), BlockPlan(home=Tier.DISK),
            name="disk-home")
PIECES = dataclasses.replace(DISK, blocks=tuple(dataclasses.replace(b, piece=64 << 10) for b in DISK.blocks),
                             rest=dataclasses.replace(DISK.rest, piece=64 << 10), name="disk-pieces")
HOST_MASTER = dataclasses.replace(DISK, blocks=tuple(dataclasses.replace(b, host_master=True) for b in DISK.blocks),
                                  rest=dataclasses.replace(PIECES.rest, host_master=True), name="disk-host-master")
PLANS = {"resident": builtin_plan("resident", N), "stream": builtin_plan("stream", N), "disk": DISK,
         "disk-pieces": PIECES,  # pieces: each rank's shard updated through host in pieces, the rest resident
         "disk-host-master": HOST_MASTER}  # masters on the host, moments on disk (the rest's in pieces)
PEAK_PLANS = {"zero-3": builtin_plan("stream", N),  # streamed and sharded: ZeRO-3-like, states on the host
              "max-offload": builtin_plan("max-offload", N, disk=True)}
CASES = [(plan, update, accum) for plan in PLANS for update in ("sync", "overlap") for accum in (1, 2)]


def _mixed(plan, world: int, shard_group: int = 0):
    """``plan`` laid out over ``world`` ranks with every other block replicated (the planner chooses each
    block's layout: ``planner.auto.per_block_layout``)."""
    laid = data_parallel(plan, world, shard_group=shard_group)
    blocks = tuple(dataclasses.replace(b, shard=i % 2 == 0) for i, b in enumerate(laid.blocks))
    return dataclasses.replace(laid, blocks=blocks, name=f"{plan.name}-mixed")


HOST_REDUCED = {name: dataclasses.replace(PLANS[name], reduce_on="host") for name in ("resident", "stream")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return one_process_checkpoint(tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, one_process):
    tmp = tmp_path_factory.mktemp("dp2")
    jobs = [(("ddp", accum, clip), functools.partial(ddp_losses, accum=accum, clip=clip))
            for accum in (1, 2) for clip in (None, 0.5)]
    jobs += [(("per micro-batch", 2), functools.partial(per_micro_losses, accum=2))]
    jobs += [((plan, update, accum, None), functools.partial(tiered_losses, plan=PLANS[plan], update=update,
                                                             accum=accum, clip=None, disk=tmp / f"{plan}{update}{accum}"))
             for plan, update, accum in CASES]
    jobs += [(("ddp-like", "sync", 1, None), functools.partial(
        tiered_losses, plan=data_parallel(PLANS["resident"], 2, shard=False), update="sync", accum=1, clip=None,
        disk=tmp / "ddp-like"))]
    jobs += [((plan, "overlap", 1, 0.5), functools.partial(tiered_losses, plan=PLANS[plan], update="overlap", accum=1,
                                                           clip=0.5, disk=tmp / f"clip{plan}"))
             for plan in ("resident", "stream")]
    jobs += [(("lockfree0", "lockfree", 1, None), functools.partial(
        tiered_losses, plan=dataclasses.replace(PLANS["stream"], max_staleness=0), update="lockfree", accum=1,
        clip=None, disk=tmp / "lockfree"))]
    jobs += [(("fixed lag", plan), functools.partial(
        tiered_losses, plan=dataclasses.replace(PLANS[plan], max_staleness=1, fixed_lag=True), update="lockfree",
        accum=1, clip=None, disk=tmp / f"lag-{plan}")) for plan in ("resident", "stream", "disk")]
    jobs += [(("fixed lag slow", plan), functools.partial(
        slow_publish_losses, plan=dataclasses.replace(PLANS[plan], max_staleness=1, fixed_lag=True),
        disk=tmp / f"lag-slow-{plan}")) for plan in ("resident", "stream")]
    jobs += [(("ddp delayed",), delayed_ddp_losses)]
    jobs += [(("events", plan), functools.partial(reduction_events, plan=PLANS[plan])) for plan in ("resident", "stream")]
    jobs += [(("disk reads",), functools.partial(disk_reads_by_thread, plan=PLANS["disk"], disk=tmp / "disk-reads"))]
    jobs += [(("mixed", plan), functools.partial(tiered_losses, plan=_mixed(PLANS[plan], 2), update="sync", accum=1,
                                                 clip=None, disk=tmp / f"mixed-{plan}")) for plan in ("resident", "stream")]
    jobs += [(("gathers", every), functools.partial(gather_events, plan=PLANS["resident"], reduce_every=every))
             for every in (None, "step")]
    jobs += [(("agreed auto",), functools.partial(agreed_auto_setup, disk=tmp / "agreed")), (("budgets",), agreed_budgets),
             (("rank 0 fails",), failure_on_rank0), (("recheck",), recheck_on_rank0)]
    jobs += [(("mismatch", what), functools.partial(mismatched_setup, what=what)) for what in ("accumulation", "plan")]
    jobs += [(("mismatched collective",), mismatched_collective)]
    jobs += [(("peaks", name), functools.partial(pool_peaks, plan=plan, disk=tmp / f"peaks-{name}"))
             for name, plan in PEAK_PLANS.items()]
    jobs += [(("saved",), functools.partial(saved_then_uninterrupted, plan=PLANS["stream"], tmp=tmp)),
             (("unshared",), functools.partial(unshared_save, tmp=tmp)),
             (("plain resumed",), functools.partial(resumed_by_parts, plan=PLANS["stream"], ckpt=one_process[0],
                                                    tmp=tmp / "plain"))]
    jobs += [(("host-reduced", name), functools.partial(tiered_losses, plan=plan, update="sync", accum=1, clip=None,
                                                        disk=tmp / f"host-{name}")) for name, plan in HOST_REDUCED.items()]
    jobs += [(("bf16", name), functools.partial(tiered_losses, plan=plan, update="sync", accum=1, clip=None,
                                                disk=tmp / f"bf16-{name}", reduce_dtype="bf16"))
             for name, plan in (("ddp-like", data_parallel(PLANS["resident"], 2, shard=False)),
                                ("zero3-like", PLANS["stream"]))]
    jobs += [(("once a step", name, update), functools.partial(
        tiered_losses, plan=PLANS[name], update=update, accum=2, clip=None, disk=tmp / f"once-{name}{update}",
        reduce_every="step", lr_decay=0.5)) for name, update in (("resident", "sync"), ("stream", "overlap"),
                                                                  ("disk", "sync"))]
    jobs += [(("ddp decayed", 2), functools.partial(ddp_losses, accum=2, clip=None, lr_decay=0.5))]
    jobs += [(("loaded after a step",), functools.partial(loaded_after_a_step, plan=PLANS["resident"]))]
    jobs += [(("once a step peaks",), functools.partial(pool_peaks, plan=PEAK_PLANS["zero-3"], disk=tmp / "once-peaks",
                                                       reduce_every="step"))]
    jobs += [(("once a step clip", name, update), functools.partial(
        tiered_losses, plan=PLANS[name], update=update, accum=2, clip=0.5, disk=tmp / f"once-clip-{name}{update}",
        reduce_every="step")) for name, update in (("resident", "sync"), ("stream", "overlap"))]
    jobs += [(("backward twice",), backward_twice), (("raised",), raised_then_trained)]
    return run_ranks(2, tmp, jobs + _sent_jobs())


def test_weights_loaded_after_a_step_that_left_its_updates_for_the_next_forward_are_what_it_reads(dp2):
    """The update the step left for a block's next use lands before ``load_state_dict`` writes the block,
    not after it (which would write the last step's update over the loaded weights)."""
    for rank in (0, 1):
        assert dp2[(("loaded after a step",), rank)] == (True, True)


@pytest.mark.parametrize("case", [("resident", "sync"), ("stream", "overlap"), ("disk", "sync")])
def test_gradients_reduced_once_a_step_equal_ddps_no_sync_bitwise(dp2, case):
    """``reduce_every="step"`` (a pipeline's DP.sync): each rank sums its micro-batches in its stage and the
    blocks are reduced at the last one, DDP's ``no_sync`` order, bit for bit, sending less than a reduction
    every micro-batch; every block's stage held through the step fits the budget the plan was resolved for
    (a count short of it fails the run). The step leaves the reductions in flight, each block landing its own
    and updating at its next use, by then under the next step's learning rate (halved after every step
    here): each takes its own step's."""
    for rank in (0, 1):
        losses, sent = dp2[(("once a step", *case), rank)]
        assert losses == dp2[(("ddp decayed", 2), rank)]
        assert sent < dp2[((case[0], case[1], 2, None), rank)][1]


def test_gradients_reduced_once_a_step_clip_by_the_steps_global_norm(dp2):
    """With clipping the norm needs every block's reduced gradients: sync lands the step's reductions before
    it, overlap (which starts every update as backward ends) lands them as backward ends; both clip as DDP
    does within the rounding of the sharded norm (relative 1e-5 over the run, step 1 bit for bit)."""
    for rank in (0, 1):
        want = dp2[(("ddp", 2, 0.5), rank)]
        for update in (("resident", "sync"), ("stream", "overlap")):
            got, _ = dp2[(("once a step clip", *update), rank)]
            assert got[0] == want[0] and got == pytest.approx(want, rel=1e-5, abs=0), (update, got, want)


def test_after_a_backward_that_raised_the_ranks_train_on_as_ddp(dp2):
    """Its reductions in flight are dropped by ``zero_grad`` and the next backward begins afresh: the steps
    after it land their reductions and train as DDP does, bit for bit."""
    for rank in (0, 1):
        assert dp2[(("raised",), rank)] == dp2[(("ddp", 1, None), rank)]


def test_a_backward_while_the_steps_reductions_are_in_flight_is_refused(dp2):
    for rank in (0, 1):
        said = dp2[(("backward twice",), rank)]
        assert "backward ran again after the last of grad_accum=1 micro-batches" in said, said


def test_gradients_reduced_once_a_step_hold_every_blocks_stage_through_the_step(dp2):
    """Each block's stage lives from its first micro-batch to its reduction at the last, and the last
    micro-batch's backward leaves every block's reduction in flight (they land as the step begins): the
    device pool holds every block's stage and reduce-scattered part at once (a reduction every micro-batch
    holds at most two of each), as ``plan.bytes.reduce_staging`` counts for ``reduce_every="step"``."""
    for rank in (0, 1):
        got = dp2[(("once a step peaks",), rank)]
        assert got["stages"] > 2 * got["stage"]  # more than a reduction every micro-batch would hold
        assert got["reducing"] == got["stages"] + got["parts"], got


@pytest.mark.parametrize("plan", ["resident", "stream"])
def test_a_blocks_gradient_reduction_runs_under_the_next_blocks_backward(dp2, plan):
    """The reduction started when a block's backward ends is waited for only when the next block's
    backward has ended (so the network carries it while that block computes), the last ones when
    backward ends; the losses above stay DDP's bit for bit."""
    for rank in (0, 1):
        events = dp2[(("events", plan), rank)]
        flushed = [b for e, b in events if e == "flush"]
        assert sorted(flushed) == list(range(len(flushed))) and len(flushed) > 2
        for earlier, later in zip(flushed, flushed[1:]):
            assert events.index(("landed", earlier)) > events.index(("flush", later)), events
        for earlier, after_next in zip(flushed, flushed[2:]):  # one in flight, not all of them
            assert events.index(("landed", earlier)) < events.index(("flush", after_next)), events
        assert [e for e, _ in events[-2:]] == ["landed", "landed"]


@pytest.mark.parametrize("every", [None, "step"])
def test_a_resident_sharded_blocks_updated_shards_are_gathered_under_the_previous_blocks_forward(dp2, every):
    """ZeRO-2: after a step each resident block's slot is stale; the next forward starts gathering
    block k+1's shards when block k's forward begins (both ranks alike), not when k+1's begins. Reduced
    once a step, the step leaves each block's update for its next use: run there, as k's forward begins."""
    for rank in (0, 1):
        events = dp2[(("gathers", every), rank)]
        second = events[events.index(events[0], 1):]  # the second step (in the first nothing is stale)
        forwards = [b for e, b in second if e == "forward"]
        assert ("ahead", forwards[0]) not in events and len(forwards) > 2
        for before, block in zip(forwards, forwards[1:]):
            assert second.index(("ahead", block)) == second.index(("forward", before)) + 1, second
    assert dp2[(("gathers", every), 0)] == dp2[(("gathers", every), 1)]


def test_lockfree_at_staleness_zero_keeps_its_meaning_per_shard_and_equals_ddp(dp2):
    for rank in (0, 1):
        assert dp2[(("lockfree0", "lockfree", 1, None), rank)][0] == dp2[(("ddp", 1, None), rank)]


@pytest.fixture(scope="module")
def dp4(tmp_path_factory, dp2):
    tmp = tmp_path_factory.mktemp("dp4")
    jobs = [(("ddp", 1), functools.partial(ddp_losses, accum=1, clip=None)),
            (("ddp", 2), functools.partial(per_micro_losses, accum=2))]  # reduced per micro-batch, as tiertrain
    jobs += [((plan, accum), functools.partial(tiered_losses, plan=PLANS[plan], update="sync", accum=accum, clip=None,
                                               disk=tmp / f"{plan}{accum}")) for plan in ("resident", "stream")
             for accum in (1, 2)]
    jobs += [(("peaks", name), functools.partial(pool_peaks, plan=plan, disk=tmp / f"peaks-{name}"))
             for name, plan in PEAK_PLANS.items()]
    jobs += [(("resumed",), functools.partial(resumed_by_parts, plan=PLANS["stream"], ckpt=dp2[(("saved",), 0)][0],
                                              tmp=tmp))]
    jobs += _hybrid_jobs(tmp, dp2[(("saved",), 0)][0])
    return run_ranks(4, tmp, jobs)


def _hybrid(plan):
    """``plan`` over 4 ranks as 2 groups of 2: each block sharded inside a group, replicated across."""
    return data_parallel(plan, 4, shard_group=2)


def _hybrid_jobs(tmp, dp2_checkpoint: str) -> list:
    jobs = [(("hybrid", plan, accum), functools.partial(tiered_losses, plan=_hybrid(PLANS[plan]), update="sync",
                                                        accum=accum, clip=None, disk=tmp / f"hybrid{plan}{accum}"))
            for plan in ("resident", "stream", "disk") for accum in (1, 2)]
    jobs += [(("ddp", 1, 0.5), functools.partial(ddp_losses, accum=1, clip=0.5)),
             (("hybrid clip",), functools.partial(tiered_losses, plan=_hybrid(PLANS["stream"]), update="overlap",
                                                  accum=1, clip=0.5, disk=tmp / "hybrid-clip")),
             (("hybrid mixed",), functools.partial(tiered_losses, plan=_mixed(PLANS["stream"], 4, shard_group=2),
                                                   update="overlap", accum=1, clip=0.5, disk=tmp / "hybrid-mixed"))]
    jobs += [(("hybrid once a step", name, update), functools.partial(  # a pipeline stage's DP.sync
        tiered_losses, plan=_hybrid(PLANS[name]), update=update, accum=2, clip=None, disk=tmp / f"honce-{name}",
        reduce_every="step", lr_decay=0.5)) for name, update in (("stream", "overlap"), ("disk", "sync"))]
    jobs += [(("ddp decayed", 2), functools.partial(ddp_losses, accum=2, clip=None, lr_decay=0.5))]
    jobs += [(("hybrid events", plan), functools.partial(reduction_events, plan=_hybrid(PLANS[plan])))
             for plan in ("resident", "stream")]
    jobs += [(("hybrid sent", name), functools.partial(sent_per_step, plan=_hybrid(plan)))
             for name, plan in (("zero2-like", PLANS["resident"]), ("zero3-like", LAYOUTS["zero3-like"]))]
    jobs += [(("hybrid peaks", name), functools.partial(pool_peaks, plan=_hybrid(plan), disk=tmp / f"hpeaks-{name}"))
             for name, plan in PEAK_PLANS.items()]
    jobs += [(("hybrid saved",), functools.partial(saved_then_uninterrupted, plan=_hybrid(PLANS["stream"]),
                                                   tmp=tmp / "hybrid-saved")),
             (("hybrid resumed",), functools.partial(resumed_by_parts, plan=_hybrid(PLANS["stream"]),
                                                     ckpt=dp2_checkpoint, tmp=tmp / "hybrid-resumed"))]
    return jobs


@pytest.mark.parametrize("plan", ["resident", "stream"])
@pytest.mark.parametrize("accum", [1, 2])
def test_at_dp4_sharded_plans_equal_ddp_within_the_rounding_of_a_four_way_sum(dp4, plan, accum):
    """Four ranks' gradients are summed in an order that depends on where an element sits in the buffer
    gloo reduces (ring segments): DDP reduces its 25 MiB buckets, tiertrain each block's chunk, so an
    element may be summed (a+b)+(c+d) here and ((a+b)+c)+d there: a few units in the last place of a
    gradient, which four AdamW steps at lr 1e-2 carry to about 1e-6 of a loss. Step 1's loss comes
    before any update: equal bit for bit."""
    for rank in range(4):
        got, _ = dp4[((plan, accum), rank)]
        want = dp4[(("ddp", accum), rank)]
        assert got[0] == want[0] and got == pytest.approx(want, rel=1e-5, abs=0)


@pytest.mark.parametrize("plan, update, accum", CASES)
def test_sharded_plans_equal_ddp_bitwise_at_dp2(dp2, plan, update, accum):
    """With accumulation each micro-batch's gradients are reduced as its backward ends (the shards are
    what a rank keeps): bitwise the plain loop that does so, and not DDP's ``no_sync`` order, which
    sums the micro-batches first (checked to differ on some rank, so the comparison tells them apart)."""
    want = ("ddp", 1, None) if accum == 1 else ("per micro-batch", 2)
    for rank in (0, 1):
        losses, _ = dp2[((plan, update, accum, None), rank)]
        assert losses == dp2[(want, rank)]
    if accum == 2:
        assert any(dp2[((plan, update, 2, None), r)][0] != dp2[(("ddp", 2, None), r)] for r in (0, 1))


def test_a_streamed_blocks_own_shard_on_disk_is_read_off_the_steps_thread(dp2):
    """A sharded block whose master is on disk fills its slot from it: its shard is read on the read
    workers from when the cache prefetches it, the gather issued at the next access (the losses of this
    plan equal DDP bitwise above); the step's own thread reads no page of it."""
    for rank in (0, 1):
        got = dp2[(("disk reads",), rank)]
        assert got["workers"] > 0 and got["step thread"] == 0, got


@pytest.mark.parametrize("plan", ["resident", "stream"])
def test_a_plan_whose_blocks_are_laid_out_each_its_own_way_equals_ddp_bitwise(dp2, plan):
    """Every other block replicated, the rest sharded (as the planner may choose per block)."""
    for rank in (0, 1):
        assert dp2[(("mixed", plan), rank)][0] == dp2[(("ddp", 1, None), rank)]


def test_a_replicated_layout_equals_ddp_bitwise_too(dp2):
    for rank in (0, 1):
        assert dp2[(("ddp-like", "sync", 1, None), rank)][0] == dp2[(("ddp", 1, None), rank)]


def test_with_clipping_the_sharded_global_norm_matches_ddp_within_rounding(dp2):
    """The global norm sums the shards' squared norms over the ranks, where torch sums per-parameter
    norms: the same real number rounded another way (relative 1e-6 in fp32), and the losses that
    follow agree to 1e-5 over the run."""
    for plan in ("resident", "stream"):
        for rank in (0, 1):
            got, _ = dp2[((plan, "overlap", 1, 0.5), rank)]
            want = dp2[(("ddp", 1, 0.5), rank)]
            assert got == pytest.approx(want, rel=1e-5) and got[0] == want[0]


def test_every_rank_takes_rank_0s_page_size_depth_and_profile_and_plans_alike(dp2):
    """Any rank but 0 that measured failed its job (``agreed_auto_setup``): rank 0 measured once, and
    the others laid out its plan with its page size and disk depth, and trained."""
    r0, r1 = dp2[(("agreed auto",), 0)], dp2[(("agreed auto",), 1)]
    assert r1["plan"] == r0["plan"] and r1["profile"] == r0["profile"]
    assert r0["page"] == r1["page"] <= 128 << 10  # measured 128 KiB; small chunks may take less
    assert r0["io"] == r1["io"] == (3, 1)
    assert len(r0["losses"]) == len(r1["losses"]) == 4 and r0["losses"][0] != r1["losses"][0]  # their own batches


def test_ranks_of_one_host_divide_what_they_take_of_it_and_all_take_the_least(dp2):
    """Rank 0 sees 8 GiB available and rank 1 4 GiB: alone, rank 1 would take a quarter (1 GiB) as its
    CPU device tier and 90% of the rest as host; two ranks of one host halve that, and both take it."""
    want = (1 << 30) // 2, int(0.9 * (3 << 30)) // 2
    given = (1 << 30) // 2, 1 << 30  # a given budget is each rank's own: not divided
    assert dp2[(("budgets",), 0)] == dp2[(("budgets",), 1)] == [want, given]


def test_a_measurement_that_fails_on_rank_0_fails_on_every_rank(dp2):
    assert dp2[(("rank 0 fails",), 0)] == "the disk under /nowhere cannot be read"
    assert dp2[(("rank 0 fails",), 1)] == ("rank 0 failed while finding the page size for every rank: "
                                           "ConfigError: the disk under /nowhere cannot be read")


def test_ranks_started_with_another_accumulation_or_plan_are_refused_at_setup_naming_the_field(dp2):
    """Such ranks would issue other collectives (a hang, or a mismatch read as a lost rank): every rank
    refuses in one message naming what differs and each rank's value."""
    for rank in (0, 1):
        said = dp2[(("mismatch", "accumulation"), rank)]
        assert said.startswith("the ranks disagree on gradient accumulation (rank 0: 1; rank 1: 2): start every rank"), said
        said = dp2[(("mismatch", "plan"), rank)]
        assert said.startswith("the ranks disagree on the plan's blocks (rank 0 holds one value, rank 1 holds another)"), said


def test_collectives_that_differ_between_ranks_surface_as_that_error_not_as_a_lost_rank(dp2):
    for rank in (0, 1):
        said = dp2[(("mismatched collective",), rank)]
        assert said.startswith(f"CollectiveFailed: all_reduce failed on rank {rank} while every rank is alive: "
                               "Detected mismatch between collectives"), said
        assert "Tensor shapes: 10vs 12" in said or "Tensor shapes: 12vs 10" in said
        assert "TensorOptions" not in said and "stopped" not in said


def test_the_recheck_runs_on_rank_0_alone_and_every_other_rank_waits_for_it(dp2):
    """Auto's recheck after the first steps probes the machine: rank 0 alone runs it (the others would
    probe one disk beside it), and the others wait until it is done (``Trainer._recheck``: no rank
    steps on while rank 0 probes its disk), keeping their prediction and printing nothing."""
    first, other = dp2[(("recheck",), 0)], dp2[(("recheck",), 1)]
    assert len(first["ran"]) == 1 and other["ran"] == []
    assert first["got"] == ["corrected", "recheck: 40% off, corrected"] and other["got"] == ["as planned", ""]
    assert other["returned"] >= first["ran"][0]


LAYOUTS = {"ddp-like": data_parallel(PLANS["resident"], 2, shard=False),
           "zero2-like": data_parallel(PLANS["resident"], 2),
           "zero3-like": data_parallel(dataclasses.replace(PLANS["stream"], window=1, prefetch=0), 2)}


def _sent_jobs() -> list:
    """Each layout's bytes a step (``sent``), run in dp2's launch."""
    jobs = [(("sent", name), functools.partial(sent_per_step, plan=plan)) for name, plan in LAYOUTS.items()]
    return jobs + [(("sent", f"{name} bf16"), functools.partial(sent_per_step, plan=LAYOUTS[name], reduce_dtype="bf16"))
                   for name in ("ddp-like", "zero3-like")]


@pytest.fixture(scope="module")
def sent(dp2):
    return {(key[1], rank): run for (key, rank), run in dp2.items() if isinstance(key, tuple) and key[0] == "sent"}


def _formula(run: dict, step: int, world: int = 2, replicas: int = 1) -> tuple[int, int]:
    """Bytes a rank sends in one step of a layout: per block, the has-gradient flags (all-reduced), the
    gradients (all-reduced where replicated, reduce-scattered where sharded), and for a sharded block
    its compute params gathered: once per step where it stays on the device (after its update), at
    every slot fetch where it streams. (inside its group of ``world`` ranks, across the ``replicas``
    groups): with hybrid sharding only the flags and each shard's all-reduce cross between groups."""
    total, across, cb = 0, 0, run["compute_bytes"]
    streamed_blocks = sum(1 for g in run["groups"] if g[3])
    for numel, n_params, sharded, streamed in run["groups"]:
        total += ring_bytes("all_reduce", n_params, world)
        total += ring_bytes("reduce_scatter" if sharded else "all_reduce", run["reduce_bytes"] * numel, world)
        across += ring_bytes("all_reduce", n_params, replicas) + ring_bytes(
            "all_reduce", run["reduce_bytes"] * numel // world, replicas)
        if sharded and not streamed and step > 0:
            total += ring_bytes("all_gather", cb * numel, world)
    if streamed_blocks:
        numel = max(g[0] for g in run["groups"] if g[3])
        total += run["fetches"][step] * ring_bytes("all_gather", cb * numel, world)
    return total, across


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_sends_what_the_layouts_formula_says(sent, layout):
    for rank in (0, 1):
        run = sent[(layout, rank)]
        assert run["sent"] == [_formula(run, k)[0] for k in range(len(run["sent"]))]
    params = 4 * sum(g[0] for g in run["groups"])  # one precision (fp32): the params' bytes
    ratio = run["sent"][-1] / (params / 2)          # per rank, in units of (N-1)/N x params bytes at N = 2
    streamed = 4 * sum(g[0] for g in run["groups"] if g[3])
    # DDP and ZeRO-2 send 2x the params; ZeRO-3 3x for the blocks that stream (gathered for forward and
    # again for backward) and 2x for the rest, which stays on the device (one block is kept between them)
    want = 2 + streamed / params
    assert want - 0.25 < ratio <= want + 0.01, (layout, ratio, want)


@pytest.mark.parametrize("layout", ["ddp-like", "zero3-like"])
def test_gradients_reduced_in_bf16_send_half_the_gradient_bytes_and_train_as_fp32_within_bf16_rounding(
        sent, dp2, layout):
    """``reduce_dtype="bf16"``: each micro-batch's gradients are staged and summed over the ranks in bf16,
    then averaged into the fp32 grad chunk: the bytes sent follow the formula with 2 bytes a gradient, and
    the losses stay within bf16's rounding of fp32's (and are not fp32's: the sum really was in bf16)."""
    for rank in (0, 1):
        run, fp32 = sent[(f"{layout} bf16", rank)], sent[(layout, rank)]
        assert run["sent"] == [_formula(run, k)[0] for k in range(len(run["sent"]))]
        assert all(a < b for a, b in zip(run["sent"], fp32["sent"]))
        got, want = dp2[(("bf16", layout), rank)][0], dp2[(("ddp", 1, None), rank)]
        assert got != want and got == pytest.approx(want, rel=2e-3), (got, want)


@pytest.mark.parametrize("plan", ["resident", "stream", "disk"])
def test_lockfree_at_a_fixed_lag_over_sharded_blocks_is_ddp_updating_a_step_late_bit_for_bit(dp2, plan):
    """A fixed lag (``Plan.fixed_lag``) over sharded blocks, resident (their gathers started ahead), streamed
    and disk-homed: every rank's job of a step publishes its shard before the block's next use waits for it,
    so every rank gathers alike, and the losses are DDP's with each update applied a step late, bit for bit;
    also where one rank's publishes come late."""
    for rank in (0, 1):
        got, _ = dp2[(("fixed lag", plan), rank)]
        assert got == dp2[(("ddp delayed",), rank)], f"rank {rank}"
        assert got != dp2[(("ddp", 1, None), rank)]  # the lag shows
        if plan != "disk":
            assert dp2[(("fixed lag slow", plan), rank)][0] == got, f"rank {rank}, its publishes late"


def test_lockfree_with_lag_over_sharded_blocks_is_refused_where_ranks_could_issue_different_collectives(monkeypatch):
    import tiertrain
    from dp_harness import _fresh
    from tiertrain.errors import ConfigError
    from tiertrain.memory import Budgets

    monkeypatch.setenv("WORLD_SIZE", "2")
    for staleness, layout in ((1, PLANS["stream"]), (4, data_parallel(builtin_plan("stream", 4), 2))):
        model, opt = _fresh()
        with pytest.raises(ConfigError, match=f"max staleness {staleness} over 2 ranks need replicated blocks"):
            tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=layout, update="lockfree",
                            max_staleness=staleness, page_size=64 << 10)


@pytest.mark.parametrize("plan", list(PEAK_PLANS))
def test_per_rank_pool_peaks_of_gradients_and_states_fall_as_one_over_the_ranks(dp2, dp4, tmp_path, plan):
    """The pools' own peaks per rank, with accumulation 2, at dp = 1 (here), 2 and 4: the host bytes of
    gradients and of each state, and the disk's, are at most 1/N of one process's (less where fewer
    states wait in the host for their updates at once: max-offload), up to each chunk's padding
    (a chunk is padded to N x 64 elements, not 64) and, for gradients, the parts of two micro-batch
    reductions landing beside the blocks' sums (each 1/N of a block). No rank keeps a whole block's
    gradients."""
    one = pool_peaks(0, PEAK_PLANS[plan], tmp_path)
    assert one["grad"] > 0 and (one["disk"] > 0) == (plan == "max-offload")
    for n, runs in ((2, dp2), (4, dp4)):
        for rank in range(n):
            got = runs[(("peaks", plan), rank)]
            pad = got["groups"] * n * 64 * 4  # bytes of padding per state a rank's chunks may add up to, times n
            for kind, states in (("master", 1), ("exp_avg", 1), ("exp_avg_sq", 1), ("disk", 3)):
                assert (got[kind] > 0) == (one[kind] > 0) and n * got[kind] <= one[kind] + states * pad, \
                    (n, rank, kind, one, got)
            landing = 2 * n * got["largest"]  # the parts of the reduction in flight and of the one starting
            assert 0 < n * got["grad"] <= one["grad"] + pad + landing, (n, rank, one, got)
            # on the device, at most two blocks' stages (and their parts) at once: what ``reduce_staging`` counts
            assert got["stage"] <= got["reducing"] <= 2 * got["stage"], (n, rank, got)
    assert one["reducing"] == 0  # one process reduces nothing


def test_a_dp4_resume_of_a_dp2_checkpoint_reads_each_ranks_share_and_trains_on_as_the_run_did(dp2, dp4):
    """Each of the four ranks reads the bytes of its own shards (checked piece by piece as they are read,
    ``checkpoint.pieces``), at most two pieces more per range and the headers: not the whole checkpoint
    to verify it, nor whole parameters to cut its part out. Steps 3-5 after the resume, on the same global
    batches split over four ranks instead of two, give the uninterrupted run's losses (another order of
    the same sums: relative 1e-5)."""
    saved = dp2[(("saved",), 0)][1]
    for rank in range(4):
        got = dp4[(("resumed",), rank)]
        print(f"rank {rank}: read {got['read']:,} B of the rank files; its share {got['share']:,} B, "
              f"the checkpoint's rank files {got['total']:,} B")
        assert 0 < got["read"] <= got["share"] + got["slack"] and got["read"] < got["total"] / 3, got
        assert got["losses"] == pytest.approx(saved, rel=1e-5, abs=0), (got["losses"], saved)


def test_a_damaged_piece_of_a_rank_file_is_refused_naming_it(dp2, tmp_path):
    """The rank files are no longer verified whole before loading: a flipped byte is found by the piece
    that holds it, as it is read (here by one process reading every rank's shards), in one message."""
    import shutil
    from pathlib import Path

    from dp_harness import WIDE
    import tiertrain
    from tiertrain.checkpoint.run import load_checkpoint
    from tiertrain.checkpoint.train_state import TieredState
    from tiertrain.errors import CheckpointError
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.train.optimizer import make_adamw

    ckpt = tmp_path / "ckpt"
    shutil.copytree(Path(dp2[(("saved",), 0)][0]), ckpt)
    shard = ckpt / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    model = build(WIDE)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    tm, _ = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 0), plan="stream", page_size=64 << 10)
    try:
        with pytest.raises(CheckpointError, match=r"shard-00001-of-00002.safetensors is damaged \(piece [0-9]+ of "
                                                  r"[0-9]+: checksum mismatch\); resume from an earlier checkpoint"):
            load_checkpoint(ckpt, TieredState(tm))
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_ranks_saving_into_directories_they_do_not_share_fail_the_save_saying_so(dp2):
    """Every rank writes into the temporary directory rank 0 made: a rank that does not see it (another
    node's filesystem) fails the save with that reason, and every rank with it."""
    assert dp2[(("unshared",), 1)].startswith("cannot save checkpoint step-00000001")
    assert dp2[(("unshared",), 1)].endswith("which rank 0 made, is not there as rank 1 sees it: every rank must save "
                                            "into one filesystem they share (--out on NFS, Lustre...) (the previous "
                                            "checkpoint is intact)")
    said = dp2[(("unshared",), 0)]
    assert said.startswith("cannot save checkpoint step-00000001 in ") and said.endswith(
        ": another rank could not write its shards (its error says why; the previous checkpoint is intact)")


def test_a_rank_killed_halfway_through_a_sharded_save_leaves_the_previous_checkpoint_intact_and_resumable(tmp_path):
    """Rank 1 is SIGKILLed after writing half its rank file of the second checkpoint: rank 0 stops naming
    it, ``latest`` still names the first checkpoint, which loads (here in one process), and the next
    save removes what the killed one left."""
    import json

    from dp_harness import WIDE
    import tiertrain
    from tiertrain.checkpoint.run import TrainerState, load_checkpoint, save_checkpoint
    from tiertrain.checkpoint.train_state import TieredState
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.train.optimizer import make_adamw

    errors, codes = run_ranks_one_dies(2, tmp_path)
    assert codes[1] == -9 and "rank 1" in errors.get(0, ""), (errors, codes)
    root = tmp_path / "killed" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000001" and (root / ".step-00000002.tmp-ranks").is_dir()
    assert not (root / "step-00000002").exists()
    model = build(WIDE)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    tm, _ = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 0), plan="stream", page_size=64 << 10)
    try:
        state = load_checkpoint(root / "step-00000001", TieredState(tm))
        assert (state.step, state.world) == (1, 2)
        save_checkpoint(tmp_path / "killed", TieredState(tm), TrainerState(3, 3, {}, {}), 2)
        assert not (root / ".step-00000002.tmp-ranks").exists()  # the killed save's leftovers, removed
        assert json.loads((root / "step-00000003" / "trainer.json").read_text())["step"] == 3
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_a_one_process_checkpoint_resumes_into_a_sharded_run_and_trains_on_as_it_did(dp2, one_process):
    """A plain checkpoint (one process, ``model.safetensors``) read into a sharded dp = 2 run: each rank
    cuts its shard out of the whole tensors, and steps 3-5 on the same global batches give the one
    process's losses (another order of the same sums: relative 1e-5)."""
    for rank in (0, 1):
        got = dp2[(("plain resumed",), rank)]
        assert got["losses"] == pytest.approx(one_process[1], rel=1e-5, abs=0), (got["losses"], one_process[1])


@pytest.mark.parametrize("plan", list(HOST_REDUCED))
def test_gradients_reduced_in_host_memory_over_the_cpu_group_equal_ddp_bitwise(dp2, plan):
    """``reduce_on="host"`` (what resolve picks where the device cannot hold the stages): the stage in host
    memory, summed over the CPU group, every tensor still on its side (the check is on), equal to DDP. The
    resident plan's gradients gather on the device (its grad tier), so the host's part is copied there."""
    for rank in (0, 1):
        assert dp2[(("host-reduced", plan), rank)][0] == dp2[(("ddp", 1, None), rank)]


# ---------------------------------------------------------------- hybrid sharding: 2 groups of 2 ranks


@pytest.mark.parametrize("plan", ["resident", "stream", "disk"])
@pytest.mark.parametrize("accum", [1, 2])
def test_hybrid_sharding_equals_ddp_within_the_rounding_of_a_four_way_sum(dp4, plan, accum):
    """Sharded inside each group of two ranks, replicated across the two groups: a gradient is summed
    (a+b) in its group, then (a+b)+(c+d) across, where DDP's four-rank ring sums in the order of its
    bucket's segments; the same tolerance as flat sharding at dp 4 (see above), step 1 bit for bit."""
    for rank in range(4):
        got, _ = dp4[(("hybrid", plan, accum), rank)]
        want = dp4[(("ddp", accum), rank)]
        assert got[0] == want[0] and got == pytest.approx(want, rel=1e-5, abs=0), (rank, got, want)


@pytest.mark.parametrize("case", [("stream", "overlap"), ("disk", "sync")])
def test_hybrid_sharding_reduced_once_a_step_equals_ddps_no_sync_within_the_rounding_of_a_four_way_sum(dp4, case):
    """``reduce_every="step"`` (a pipeline stage's DP.sync) with hybrid sharding: the last micro-batch leaves
    each block's two collectives chained in flight (the reduce-scatter inside the group, then the shard's
    all-reduce across), landed at each block's next use (``tiered_losses`` checks they were left so) under
    the next step's learning rate; the losses are DDP's with no_sync within the four-way sum's rounding."""
    for rank in range(4):
        got, _ = dp4[(("hybrid once a step", *case), rank)]
        want = dp4[(("ddp decayed", 2), rank)]
        assert got[0] == want[0] and got == pytest.approx(want, rel=1e-5, abs=0), (rank, got, want)


def test_hybrid_clipping_counts_each_shard_once_in_the_global_norm(dp4):
    """Each shard is held by both groups: its squared norm is summed over its group alone (over every
    rank it would count twice, and clipping at 0.5 would clip harder than DDP: the losses would part)."""
    for rank in range(4):
        want = dp4[(("ddp", 1, 0.5), rank)]
        for key in (("hybrid clip",), ("hybrid mixed",)):  # mixed: every other block replicated over all 4
            got, _ = dp4[(key, rank)]
            assert got[0] == want[0] and got == pytest.approx(want, rel=1e-5, abs=0), (key, rank, got, want)


@pytest.mark.parametrize("plan", ["resident", "stream"])
def test_a_shards_all_reduce_across_groups_runs_under_the_next_blocks_backward(dp4, plan):
    """Hybrid: a block's reduce-scatter inside its group runs under the next block's backward; once that
    has ended its shard's all-reduce across the groups is issued and runs under the backward after it, so
    two reductions are in flight (what the budget counts: ``plan.bytes.reductions_in_flight``) and the
    slow link is never waited on at once."""
    for rank in range(4):
        events = dp4[(("hybrid events", plan), rank)]
        flushed = [b for e, b in events if e == "flush"]
        assert len(flushed) > 3, events
        for b0, b1, b2 in zip(flushed, flushed[1:], flushed[2:]):
            assert events.index(("flush", b1)) < events.index(("across", b0)) < events.index(("flush", b2)), events
            assert events.index(("flush", b2)) < events.index(("landed", b0)), events
        for b0, b3 in zip(flushed, flushed[3:]):
            assert events.index(("landed", b0)) < events.index(("flush", b3)), events


@pytest.mark.parametrize("layout", ["zero2-like", "zero3-like"])
def test_hybrid_sharding_sends_gathers_inside_a_group_and_only_shards_across(dp4, layout):
    """Inside its group a rank sends what flat sharding over two ranks sends (the gathers, the
    reduce-scatters); across the groups only the has-gradient flags and each shard's all-reduce: 2 (R-1)/R
    of a shard, half of the gradient bytes per rank at 2 x 2, where flat sharding over 4 ranks sends every
    gather and reduce-scatter over the ring that crosses between the groups."""
    for rank in range(4):
        run = dp4[(("hybrid sent", layout), rank)]
        steps = range(len(run["within"]))
        assert run["within"] == [_formula(run, k, world=2, replicas=2)[0] for k in steps]
        assert run["across"] == [_formula(run, k, world=2, replicas=2)[1] for k in steps]
        grads = 4 * sum(g[0] for g in run["groups"])
        assert grads / 2 <= run["across"][-1] < grads / 2 + grads / 100, (run["across"], grads)
        assert run["sent"] == [0] * len(run["sent"])  # nothing of a step on the run's flat group


@pytest.mark.parametrize("plan", PEAK_PLANS)
def test_hybrid_ranks_hold_what_flat_sharding_over_their_group_holds(dp2, dp4, plan):
    """A rank of 2 x 2 holds half of each block's states and gradients, as a rank of flat dp 2 does (the
    pools' own peaks): hybrid sharding trades memory (1/2, not 1/4) for traffic between groups. Its
    gradients hold at most one part more: two reductions are in flight, not one (the shard's all-reduce
    across groups runs under a second block's backward), each landing in a fresh chunk beside the sum."""
    for rank in range(4):
        got, flat = dp4[(("hybrid peaks", plan), rank)], dp2[(("peaks", plan), rank % 2)]
        for k in ("master", "exp_avg", "exp_avg_sq", "disk"):
            assert got[k] == flat[k], (plan, rank, k, got[k], flat[k])
        assert flat["grad"] <= got["grad"] <= flat["grad"] + got["largest"], (plan, rank, got, flat)


def test_a_hybrid_checkpoint_is_one_file_per_shard_and_resumes_in_one_process_as_the_run_went_on(dp2, dp4, tmp_path):
    """The first group writes the two rank files (the second holds the same shards); the map says the
    run had four ranks (a resume keeps them). One process resumes it and trains on the whole batches with
    the uninterrupted run's losses; a dp 2 checkpoint resumed by the 2 x 2 mesh reads each rank's share."""
    from pathlib import Path

    from tiertrain.checkpoint.run import read_trainer, saved_world

    ckpt, saved = dp4[(("hybrid saved",), 0)]
    assert sorted(p.name for p in Path(ckpt).glob("shard-*.safetensors")) == [
        "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert read_trainer(Path(ckpt)).shards["ranks"] == 4 and saved_world(Path(ckpt)) == 4
    one = resumed_by_parts(0, builtin_plan("stream", N), ckpt, tmp_path)
    assert one["losses"] == pytest.approx(saved, rel=1e-5, abs=0), (one["losses"], saved)
    for rank in range(4):
        got = dp4[(("hybrid resumed",), rank)]
        assert 0 < got["read"] <= got["share"] + got["slack"] and got["read"] < got["total"] / 1.5, got
        assert got["losses"] == pytest.approx(dp2[(("saved",), 0)][1], rel=1e-5, abs=0)
