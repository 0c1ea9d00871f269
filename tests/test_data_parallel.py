"""Data parallel over gloo ranks (issue 19): sharded (ZeRO-2/3-like) and replicated (DDP-like) block
groups train as torch's DistributedDataParallel does, bit for bit at dp = 2 in fp32 (a sum of two is
the same in any order, and halving is exact), with accumulation; with clipping and at dp = 4 within
a stated tolerance; each rank sends the bytes the layouts' formulas say."""

import dataclasses
import functools

import pytest

from dp_harness import TINY4, ddp_losses, run_ranks, tiered_losses
from tiertrain.memory import Tier
from tiertrain.plan import BlockPlan, Plan, builtin_plan, data_parallel

N = TINY4["n_layer"]
DISK = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in range(N)), BlockPlan(home=Tier.DISK),
            name="disk-home")
PLANS = {"resident": builtin_plan("resident", N), "stream": builtin_plan("stream", N), "disk": DISK}
CASES = [(plan, update, accum) for plan in PLANS for update in ("sync", "overlap") for accum in (1, 2)]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    jobs = [(("ddp", accum, clip), functools.partial(ddp_losses, accum=accum, clip=clip))
            for accum in (1, 2) for clip in (None, 0.5)]
    jobs += [((plan, update, accum, None), functools.partial(tiered_losses, plan=PLANS[plan], update=update,
                                                             accum=accum, clip=None, disk=tmp / f"{plan}{update}{accum}"))
             for plan, update, accum in CASES]
    jobs += [(("ddp-like", "sync", 1, None), functools.partial(
        tiered_losses, plan=data_parallel(PLANS["resident"], 2, shard=False), update="sync", accum=1, clip=None,
        disk=tmp / "ddp-like"))]
    jobs += [((plan, "overlap", 1, 0.5), functools.partial(tiered_losses, plan=PLANS[plan], update="overlap", accum=1,
                                                           clip=0.5, disk=tmp / f"clip{plan}"))
             for plan in ("resident", "stream")]
    return run_ranks(2, tmp, jobs)


@pytest.mark.parametrize("plan, update, accum", CASES)
def test_sharded_plans_equal_ddp_bitwise_at_dp2(dp2, plan, update, accum):
    for rank in (0, 1):
        losses, _ = dp2[((plan, update, accum, None), rank)]
        assert losses == dp2[(("ddp", accum, None), rank)]


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
