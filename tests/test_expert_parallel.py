"""Expert parallel MoE (issue 19 item 4): at dp = 2, ep = 2 each rank holds half of every MoE layer's
experts, tokens travel to their expert's rank by all-to-all, and the run equals single-process
training of the same MoE on both ranks' batches.

What equals what. Rank r's batch at step s is micro-batch r of a one-process step with gradient
accumulation 2 over the concatenation of both ranks' batches (each micro-batch's loss is its mean
cross-entropy plus 0.01 x its Switch load-balancing loss, divided by 2, as any accumulation does).
Rank r's loss at step s equals that micro-batch's loss bit for bit, at every step, so the trained
weights are equal bit for bit. Why it can: the dense parameters' gradients are each rank's own,
averaged (g0 + g1) / 2 = g0/2 + g1/2 exactly (halving is exact); an expert runs once per sending rank,
on exactly the rows that rank's batch routed to it, as micro-batch r runs it, and its two gradients are
summed (a sum of two is the same in either order) and halved; outputs are combined in expert order
and token gradients summed in the order a one-process backward sums them.

A one-process step on the concatenation as one batch of 4 sequences differs in two ways: its
load-balancing loss is taken over all 4 sequences (a product of means, not the mean of the two
ranks' products: not equal even in exact arithmetic, so that comparison runs with the coefficient at
0), and its gradients sum 64 tokens in one matmul where ep sums 32 and 32 and adds: the same real
numbers rounded in another order, a few units in the last place of a gradient. Eight AdamW steps at
lr 1e-2 carry that to about 2e-7 of a loss (measured); the test allows 1e-5.
"""

import dataclasses
import functools

import pytest
import torch

from dp_harness import rank_batches, rank_disk, run_ranks
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, Tier
from tiertrain.plan import ParallelLayout, Plan, builtin_plan, data_parallel

MOE = {"n_layer": 2, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256, "max_seq_len": 64, "n_experts": 4,
       "top_k": 2}
NO_AUX = {**MOE, "aux_loss_coef": 0.0}
SPARSE = {**MOE, "n_experts": 8, "top_k": 1}  # with 4 tokens a rank: experts idle on one replica, busy on another
TWO = {**MOE, "n_experts": 2, "top_k": 1}     # with 5 tokens a rank: a layer's experts all busy on one rank only
STEPS = 5
N = MOE["n_layer"]


def _fresh(cfg: dict, seed: int = 0):
    from tiertrain.train.optimizer import make_adamw
    from tiertrain.models import build

    torch.manual_seed(seed)
    model = build(cfg)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    return model, opt


def _step_loss(model, b, tokens: int | None = None) -> torch.Tensor:
    from tiertrain.train.objective import lm_loss

    if tokens is not None:
        b = b[:1, : tokens + 1]
    return lm_loss(model, b[:, :-1], b[:, 1:])


def one_process(rank: int, cfg: dict, clip: float | None, concat: bool, steps: int = STEPS, world: int = 2,
                tokens: int | None = None, accum: int = 1):
    """Rank 0 alone: plain PyTorch over every rank's batches (accumulated: each rank's ``accum``
    micro-batches, in turn; or ``concat``: as one batch); its losses per (step, rank) and, per step and
    micro-batch, how many of each layer's routed rows go to each expert."""
    if rank:
        return None
    torch.set_num_threads(1)  # as the ranks run: one thread each, so no kernel splits a sum another way
    model, opt = _fresh(cfg)
    routed: list[torch.Tensor] = []
    for blk in model.blocks:
        blk.ffn.router.register_forward_hook(
            lambda m, a, out: routed.append(torch.bincount(
                out.float().softmax(-1).topk(cfg["top_k"]).indices.reshape(-1), minlength=cfg["n_experts"])))
    data, losses, counts = [rank_batches(r, steps * accum) for r in range(world)], [], []
    for s in range(steps):
        if concat:
            loss = _step_loss(model, torch.cat([data[0][s], data[1][s]]))
            loss.backward()
            losses.append([loss.item()])
        else:
            row = [0.0] * world
            for a in range(accum):
                for r in range(world):
                    loss = _step_loss(model, data[r][s * accum + a], tokens) / accum
                    (loss / world).backward()
                    row[r] += loss.item()
            losses.append(row)
            counts.append([c.tolist() for c in routed])  # [micro-batch 0's layers..., micro-batch 1's layers...]
        routed.clear()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, counts


def expert_parallel_run(rank: int, cfg: dict, plan: Plan, update: str, clip: float | None, disk,
                        steps: int = STEPS, tokens: int | None = None, accum: int = 1):
    """This rank at ep = 2: its losses, and per step the bytes of tokens it sent to the other rank.
    Each rank draws other initial weights (seed = rank): rank 0's must become every rank's."""
    import tiertrain

    torch.set_num_threads(1)
    model, opt = _fresh(cfg, seed=rank)
    budgets = Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank))
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, update=update, max_grad_norm=clip, grad_accum=accum,
                               page_size=64 << 10)
    rt, out = tm.runtime, {"losses": [], "sent": []}
    try:  # the device pool maps what the plan counts, the held experts' slots and states among it
        assert rt.mem.pool(Tier.DEVICE).capacity == rt.plan.resolved.device < budgets.device
        assert sum(rt.plan.resolved.experts) > 0
        out["held"] = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in tm.named_parameters()
                              if ".experts." in n})
        data = rank_batches(rank, steps * accum)
        for s in range(steps):
            before, total = rt.experts.sent, 0.0
            for b in data[s * accum:(s + 1) * accum]:
                loss = _step_loss(tm, b, tokens) / accum
                loss.backward()
                total += loss.item()
            if clip:
                torch.nn.utils.clip_grad_norm_(tm.parameters(), clip)
            topt.step()
            topt.zero_grad()
            out["losses"].append(total)
            out["sent"].append(rt.experts.sent - before)
        return out
    finally:
        rt.close()
        rt.mem.close()


def data_parallel_moe(rank: int, cfg: dict, disk, tokens: int, steps: int = STEPS) -> list[float]:
    """This rank at dp = 2 with every expert on every rank (ep = 1): its losses."""
    import tiertrain

    torch.set_num_threads(1)
    model, opt = _fresh(cfg)
    budgets = Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank))
    tm, topt = tiertrain.setup(model, opt, budgets, plan=data_parallel(builtin_plan("resident", N), 2), update="sync",
                               page_size=64 << 10)
    try:
        losses = []
        for b in rank_batches(rank, steps):
            loss = _step_loss(tm, b, tokens)
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def _ep2(plan: Plan) -> Plan:
    return data_parallel(plan, 2, ep=2)


PLANS = {
    "resident": _ep2(builtin_plan("resident", N)),                       # ZeRO-2-like dense blocks
    "stream": _ep2(builtin_plan("stream", N)),                           # ZeRO-3-like dense blocks
    "replicated": data_parallel(builtin_plan("resident", N), 2, shard=False, ep=2),  # DDP-like dense blocks
    "recompute": _ep2(builtin_plan("max-offload", N, disk=True)),        # the exchange runs again in backward
    "lockfree": _ep2(dataclasses.replace(builtin_plan("stream", N), max_staleness=0)),
}
CASES = [("resident", "sync"), ("stream", "overlap"), ("replicated", "sync"), ("recompute", "overlap"),
         ("lockfree", "lockfree")]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep2")
    jobs = [("one", functools.partial(one_process, cfg=MOE, clip=None, concat=False)),
            ("one-clip", functools.partial(one_process, cfg=MOE, clip=0.5, concat=False)),
            ("concat", functools.partial(one_process, cfg=NO_AUX, clip=None, concat=True, steps=8)),
            ("ep-no-aux", functools.partial(expert_parallel_run, cfg=NO_AUX, plan=PLANS["resident"], update="sync",
                                            clip=None, disk=tmp / "na", steps=8)),
            ("ep-clip", functools.partial(expert_parallel_run, cfg=MOE, plan=PLANS["stream"], update="overlap",
                                          clip=0.5, disk=tmp / "clip")),
            ("one-accum", functools.partial(one_process, cfg=MOE, clip=None, concat=False, accum=2)),
            ("ep-accum", functools.partial(expert_parallel_run, cfg=MOE, plan=PLANS["stream"], update="overlap",
                                           clip=None, disk=tmp / "accum", accum=2))]
    jobs += [((plan, update), functools.partial(expert_parallel_run, cfg=MOE, plan=PLANS[plan], update=update,
                                                clip=None, disk=tmp / f"{plan}{update}"))
             for plan, update in CASES]
    jobs += [("one-two", functools.partial(one_process, cfg=TWO, clip=None, concat=False, tokens=5)),
             ("dp-two", functools.partial(data_parallel_moe, cfg=TWO, disk=tmp / "dp-two", tokens=5))]
    return run_ranks(2, tmp, jobs)


def test_moe_at_ep1_over_two_ranks_where_an_expert_idles_on_one_rank_only_equals_one_process_bitwise(ep2):
    """With every expert on every rank, an expert that gets no token on one rank has no gradient
    there: that block's gradients cannot be reduced as soon as its backward ends on one rank and at
    the end on the other (the ranks' collectives would pair different blocks), so a block holding
    mixture-of-experts layers reduces when backward ends, on every rank."""
    want, counts = ep2[("one-two", 0)]
    busy = [[all(c > 0 for c in layer) for layer in step] for step in counts]  # rank 0's layers, then rank 1's
    assert any(step[:N] != step[N:] for step in busy), "the case needs a layer whose experts all ran on one rank only"
    for rank in (0, 1):
        assert ep2[("dp-two", rank)] == [row[rank] for row in want]


@pytest.mark.parametrize("plan, update", CASES)
def test_moe_at_ep2_equals_single_process_accumulation_over_both_ranks_batches_bitwise(ep2, plan, update):
    want, _ = ep2[("one", 0)]
    for rank in (0, 1):
        got = ep2[((plan, update), rank)]
        assert got["held"] == [["0", "1"], ["2", "3"]][rank]  # each rank holds its half of the experts
        assert got["losses"] == [row[rank] for row in want]


def test_moe_at_ep2_equals_one_batch_of_both_ranks_sequences_within_rounding(ep2):
    """The mean of the two ranks' losses against one batch of all 4 sequences (no load-balancing loss:
    see the module's docstring): relative 1e-5, measured 2e-7; step 1 is before any update, but its mean
    of two fp32 means is rounded otherwise than one fp32 mean of 64 tokens."""
    want = [row[0] for row in ep2[("concat", 0)][0]]
    got = [ep2[("ep-no-aux", r)]["losses"] for r in (0, 1)]
    mean = [(a + b) / 2 for a, b in zip(*got)]
    assert mean == pytest.approx(want, rel=1e-5, abs=0)


def test_with_clipping_the_norm_over_every_ranks_experts_matches_within_rounding(ep2):
    """The global norm sums the dense shards' and the held experts' squared norms over the ranks where
    torch sums per-parameter norms: the same real number rounded otherwise (relative 1e-6 in fp32), and
    the losses that follow agree to 1e-5 over the run; step 1's come before any update: bit for bit."""
    want, _ = ep2[("one-clip", 0)]
    for rank in (0, 1):
        got = ep2[("ep-clip", rank)]["losses"]
        column = [row[rank] for row in want]
        assert got[0] == column[0] and got == pytest.approx(column, rel=1e-5, abs=0)


def test_with_accumulation_each_micro_batch_reduced_over_the_ranks_equals_one_process_within_rounding(ep2):
    """Two micro-batches a rank, each reduced over the ranks as its backward ends: (a + c) + (b + d) where
    one process accumulates the four micro-batches ((a + c) + b) + d: another rounding order (about 1e-7
    of a loss over the run, measured); 1e-5 allowed, step 1 (before any update) bit for bit."""
    want, _ = ep2[("one-accum", 0)]
    for rank in (0, 1):
        got = ep2[("ep-accum", rank)]["losses"]
        column = [row[rank] for row in want]
        assert got[0] == column[0] and got == pytest.approx(column, rel=1e-5, abs=0)


@pytest.mark.parametrize("plan, update", CASES)
def test_each_rank_sends_the_tokens_routed_to_the_other_ranks_experts_and_their_gradients(ep2, plan, update):
    """Per layer a rank sends the rows its batch routed to the other rank's experts, and returns the
    outputs of the rows the other rank routed to its own: (out + in) rows of d_model fp32 values, and
    again in backward (the gradients, reversed); a recomputed block exchanges its forward's once more.
    Routing counted from the one-process run's routers, which see the same weights."""
    _, counts = ep2[("one", 0)]
    passes = 3 if PLANS[plan].blocks[0].recompute else 2
    for rank in (0, 1):
        mine, theirs = (range(0, 2), range(2, 4)) if rank == 0 else (range(2, 4), range(0, 2))
        want = []
        for step in counts:
            own, other = step[rank * N:(rank + 1) * N], step[(1 - rank) * N:(2 - rank) * N]
            rows = sum(sum(c[e] for e in theirs) for c in own) + sum(sum(c[e] for e in mine) for c in other)
            want.append(passes * rows * MOE["d_model"] * 4)
        assert ep2[((plan, update), rank)]["sent"] == want


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp4")
    jobs = [("one", functools.partial(one_process, cfg=MOE, clip=None, concat=False, world=4)),
            ("one-sparse", functools.partial(one_process, cfg=SPARSE, clip=None, concat=False, world=4, tokens=4))]
    jobs += [((plan, update), functools.partial(expert_parallel_run, cfg=MOE, plan=data_parallel(
        builtin_plan(plan, N), 4, ep=2), update=update, clip=None, disk=tmp / plan))
        for plan, update in (("resident", "sync"), ("stream", "overlap"))]
    jobs += [("sparse", functools.partial(expert_parallel_run, cfg=SPARSE, plan=data_parallel(
        builtin_plan("stream", N), 4, ep=2), update="overlap", clip=None, disk=tmp / "sparse", tokens=4))]
    return run_ranks(4, tmp, jobs)


@pytest.mark.parametrize("plan, update", [("resident", "sync"), ("stream", "overlap"), ("sparse", "overlap")])
def test_at_dp4_ep2_each_expert_has_two_replicas_and_training_equals_one_process_within_rounding(dp4, plan, update):
    """Ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3 (expert groups {0, 1} and {2, 3}). An
    expert's gradient is summed over its expert group's tokens, then over its replicas: (a + b) + (c + d)
    where one process accumulates ((a + b) + c) + d, a few units in the last place, which five AdamW
    steps carry to about 1e-7 of a loss (measured); 1e-5 allowed, step 1 (before any update) bit for bit.
    ``sparse``: 8 experts, top-1, 4 tokens a rank, so an expert often gets tokens on one replica and none
    on the other: the replicas still reduce together (when backward ends), and an expert no rank routed
    to is not stepped, as torch skips a parameter without a gradient."""
    want, _ = dp4[("one-sparse" if plan == "sparse" else "one", 0)]
    for rank in range(4):
        got = dp4[(plan if plan == "sparse" else (plan, update), rank)]
        column = [row[rank] for row in want]
        held = [str(e) for e in (range(4 * (rank % 2), 4 * (rank % 2) + 4) if plan == "sparse"
                                 else range(2 * (rank % 2), 2 * (rank % 2) + 2))]
        assert got["held"] == held
        assert got["losses"][0] == column[0] and got["losses"] == pytest.approx(column, rel=1e-5, abs=0)


def test_expert_parallel_layouts_are_plan_data_and_bad_ones_are_refused_in_one_message():
    laid = data_parallel(builtin_plan("stream", 2), 4, ep=2)
    assert laid.parallel == ParallelLayout(dp=4, ep=2) and Plan.from_json(laid.to_json()) == laid
    assert builtin_plan("stream", 2).parallel.to_dict() == {"dp": 1}  # unchanged for plans without experts
    with pytest.raises(ConfigError, match="ep=3 does not divide the 4 data-parallel ranks; choose ep among 1, 2, 4"):
        ParallelLayout(dp=4, ep=3)
    with pytest.raises(ConfigError, match="ep=3 does not divide"):
        Plan.from_json(laid.to_json().replace('"ep": 2', '"ep": 3'))


def test_expert_parallel_needs_moe_layers_that_ep_divides_and_more_than_one_process():
    import tiertrain
    from tiertrain.models import build
    from tiertrain.parallel import LocalCollectives
    from tiertrain.parallel.experts import apply_expert_parallel

    with pytest.raises(ConfigError, match="ep=2 does not divide the model's 3 experts; choose ep among 1, 3"):
        apply_expert_parallel(LocalCollectives(), 6, 2, build({**MOE, "n_experts": 3}))
    with pytest.raises(ConfigError, match="has no mixture-of-experts layer"):
        apply_expert_parallel(LocalCollectives(), 2, 2, build({**MOE, "n_experts": 0}))
    model, opt = _fresh(MOE)
    with pytest.raises(ConfigError, match="ep=2 .* this run has one process: launch it on 2 times the ranks"):
        tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="resident", ep=2)


def test_an_moe_layer_keeps_its_experts_names_when_it_holds_some_of_them():
    from tiertrain.models import build

    model = build(MOE)
    ffn = model.blocks[0].ffn
    ffn.keep_experts(range(2, 4), exchange=lambda moe, tokens, rows: [])
    names = [n for n, _ in ffn.named_parameters()]
    assert names == ["router.weight", "experts.2.fc.weight", "experts.2.fc.bias", "experts.2.proj.weight",
                     "experts.2.proj.bias", "experts.3.fc.weight", "experts.3.fc.bias", "experts.3.proj.weight",
                     "experts.3.proj.bias"]
    assert ffn.expert(3) is ffn.experts["3"]
