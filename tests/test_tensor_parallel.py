"""Tensor parallel (issue 39): our GPT's blocks cut over gloo ranks, each rank's shards in tiers, against
one process of plain PyTorch on the same batches. Two launches: tp = 2, and dp = 2 x tp = 2.

Tolerance: a row-parallel layer sums its input features in two halves, one per rank, and adds the halves
(plain PyTorch sums them in one pass): each such output may differ by an ulp or so, and AdamW's first steps
(update about lr x sign) carry that on without growing it. Losses over 3 steps within 1e-5 relative
(about 80 fp32 ulps) allow that and nothing more: a shard cut wrong, a head misplaced or a sum missing
moves the loss by 1e-3 or more. (At this model's widths they came out equal bit for bit.)"""

from __future__ import annotations

import functools

import pytest
import torch
from delayed_update import DelayedAdamW
from dp_harness import run_ranks
from pp_harness import TINY, Case, fresh, pipelined_losses, reference
from tp_harness import TpCase, groups_left, refused, tp_losses

RTOL = 1e-5
TP2 = [TpCase(2), TpCase(2, plan="disk", clip=0.05), TpCase(2, plan="stash", clip=0.05, tied=True),
       TpCase(2, update="overlap"), TpCase(2, skew=True), TpCase(2, plan="disk", clip=0.05, family="llama"),
       TpCase(2, tied=True, family="llama"), TpCase(2, skew=True, family="qwen2"),
       TpCase(2, plan="disk", clip=0.05, tied=True, family="gpt2"), TpCase(2, update="overlap", family="gpt_neox"),
       TpCase(2, plan="disk", clip=0.05, family="moe"), TpCase(2, plan="stash", family="moe"),
       TpCase(2, clip=0.05, sequence=True), TpCase(2, plan="stash", clip=0.05, tied=True, sequence=True),
       TpCase(2, plan="resident"), TpCase(2, plan="resident", sequence=True),
       TpCase(2, plan="disk", update="lockfree", staleness=0), TpCase(2, update="lockfree", staleness=0, sequence=True),
       TpCase(2, plan="stash", clip=0.05, sequence=True, family="llama"),
       TpCase(2, plan="disk", tied=True, sequence=True, family="gpt2"), TpCase(2, sequence=True, family="gpt_neox"),
       TpCase(2, plan="disk", clip=0.05, sequence=True, family="moe"), TpCase(2, plan="stash", sequence=True, family="moe")]
# lockfree at its default lag (1): the group runs at a fixed lag (ZeRO-Offload's delayed parameter update)
LAGGED = [TpCase(2, update="lockfree"), TpCase(2, plan="disk", update="lockfree", staleness=1, family="llama"),
          TpCase(2, plan="resident", update="lockfree", sequence=True)]
META = TpCase(2, plan="resident", meta=True)
META_MOE = TpCase(2, plan="resident", meta=True, family="moe")  # its routers, whole, drawn by the group too
DP2_LAGGED = TpCase(2, plan="disk", update="lockfree")  # sharded over the replicas, at a fixed lag
DP2_TP2 = [TpCase(2, clip=0.05), TpCase(2, plan="disk"), TpCase(2, plan="disk", clip=0.05, sequence=True),
           TpCase(2, plan="disk", update="lockfree", staleness=0), TpCase(2, plan="disk", clip=0.05, family="moe", ep=2)]


# dp = 4 x tp = 2 (8 ranks): each data-parallel group split again, inside the dp x tp mesh (parallel.mesh):
# sharded over pairs of replicas and replicated across them (hybrid), or experts divided over pairs of replicas
DP4_TP2 = [TpCase(2, plan="disk", clip=0.05, shard_group=2), TpCase(2, plan="disk", clip=0.05, family="moe", ep=2)]
EP_SAVED = TpCase(2, plan="disk", family="moe", ep=2)  # dp = 2 x tp = 2, its experts over the replicas: saved
# pp = 2 x dp = 4 (the same 8 ranks): each stage's blocks sharded over pairs of its replicas (hybrid)
PP2_DP4 = [Case("1f1b", 2, 1, plan="disk", clip=0.05, shard_group=2), Case("aiao", 4, 2, shard_group=2)]


def _jobs(cases, disk):
    return [((c,), functools.partial(tp_losses, case=c, disk=disk / f"{i}")) for i, c in enumerate(cases)]


SAVED = TpCase(2, plan="disk")  # saved after its first step; its steps 2 and 3 are what a resume must give


PP2_TP2 = [Case("1f1b", 2, 1, clip=0.05), Case("aiao", 4, 2, plan="disk"), Case("aiao", 2, 2, plan="stash", clip=0.05),
           Case("aiao", 4, 2, plan="disk", clip=0.05, family="llama"), Case("1f1b", 2, 1, family="gpt2"),
           Case("aiao", 4, 2, plan="disk", family="gpt_neox"), Case("1f1b", 2, 1, clip=0.05, sequence=True),
           Case("aiao", 4, 2, plan="stash", sequence=True), Case("1f1b", 2, 1, clip=0.05, family="llama"),
           Case("1f1b", 2, 1, clip=0.05, family="llama", sequence=True),
           Case("aiao", 4, 2, plan="stash", family="gpt_neox", sequence=True),
           Case("1f1b", 2, 1, plan="disk", clip=0.05, family="gpt2", sequence=True),
           Case("aiao", 4, 2, plan="disk", family="moe"), Case("1f1b", 2, 1, clip=0.05, family="moe", sequence=True)]
PP_SAVED = Case("1f1b", 2, 1, plan="disk")  # pp = 2 x tp = 2, saved after its first step


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory):
    """The 4-rank launch: dp = 2 x tp = 2, and pp = 2 x tp = 2 in the same processes."""
    disk, out = tmp_path_factory.mktemp("dp2tp2d"), tmp_path_factory.mktemp("dp2tp2run")
    jobs = _jobs([*DP2_TP2, DP2_LAGGED], disk) + [(("saved",), functools.partial(tp_losses, case=SAVED, disk=disk / "s", save_to=out))]
    jobs += [(("pp", c), functools.partial(pipelined_losses, case=c, pp=2, disk=disk / f"pp{i}", tp=2))
             for i, c in enumerate(PP2_TP2)]
    whole = tmp_path_factory.mktemp("tp1run")  # tp = 1 over 4 replicas: a checkpoint the tp2 launch cuts again
    jobs += [(("saved tp1",), functools.partial(tp_losses, case=TpCase(1, plan="disk"), disk=disk / "w", save_to=whole))]
    staged = tmp_path_factory.mktemp("pptprun")  # pp = 2 x tp = 2: resumed by the tp2 launch, and in one process
    jobs += [(("pp saved",), functools.partial(pipelined_losses, case=PP_SAVED, pp=2, disk=disk / "ps", tp=2,
                                               save_to=staged)),  # then resumed at its own layout, as train --resume
             (("pp same",), functools.partial(pipelined_losses, case=PP_SAVED, pp=2, disk=disk / "pr", tp=2,
                                              load_from=staged))]
    piped = tmp_path_factory.mktemp("pprun")  # pp = 2 x dp = 2, no tp: a checkpoint saved whole, cut by tp2's
    jobs += [(("pp whole",), functools.partial(pipelined_losses, case=Case("1f1b", 2, 1, plan="disk"), pp=2,
                                               disk=disk / "pw", save_to=piped))]
    experts = tmp_path_factory.mktemp("eptprun")
    jobs += [(("ep saved",), functools.partial(tp_losses, case=EP_SAVED, disk=disk / "e", save_to=experts))]
    return {**run_ranks(4, tmp_path_factory.mktemp("dp2tp2"), jobs), "out": out, "tp1 out": whole, "pp out": staged,
            "pp whole": piped, "ep out": experts}


@pytest.fixture(scope="module")
def dp4_tp2(tmp_path_factory):
    """The 8-rank launch: dp = 4 x tp = 2 and pp = 2 x dp = 4, the data-parallel groups split again inside
    their mesh (hybrid sharding, experts)."""
    disk = tmp_path_factory.mktemp("dp4tp2d")
    jobs = _jobs(DP4_TP2, disk) + [(("pp", c), functools.partial(pipelined_losses, case=c, pp=2, disk=disk / f"pp{i}"))
                                   for i, c in enumerate(PP2_DP4)]
    jobs += [(("left", c), functools.partial(groups_left, case=c, disk=disk / f"left{i}")) for i, c in enumerate(DP4_TP2)]
    return run_ranks(8, tmp_path_factory.mktemp("dp4tp2"), jobs)


def _saved_by_one_process(out) -> None:
    """One step of plain PyTorch and its checkpoint (a one-process run's files, no record of a group)."""
    from pp_harness import batches, fresh, loss_of

    from tiertrain.checkpoint.run import TrainerState, save_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    model, opt = fresh()
    b = batches(0)[0]
    loss_of(model, b[:, :-1], b[:, 1:]).backward()
    opt.step()
    save_checkpoint(out, PlainState(model, opt, _names(model)), TrainerState(step=1, data_position=0, scaler={}, run_config={}), 2)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, dp2_tp2):
    disk, out = tmp_path_factory.mktemp("tp2d"), tmp_path_factory.mktemp("tp2run")
    plain = tmp_path_factory.mktemp("plainrun")
    _saved_by_one_process(plain)
    jobs = _jobs([*TP2, META, META_MOE, *LAGGED], disk) + [
        (("saved",), functools.partial(tp_losses, case=SAVED, disk=disk / "s", save_to=out)),
        (("resumed",), functools.partial(tp_losses, case=TpCase(2), disk=disk / "r", load_from=dp2_tp2["out"])),
        (("resumed tp1",), functools.partial(tp_losses, case=TpCase(2), disk=disk / "c",
                                             load_from=dp2_tp2["tp1 out"])),
        (("pp resumed",), functools.partial(pipelined_losses, case=Case("aiao", 2, 2, plan="disk"), pp=2,
                                            disk=disk / "p", load_from=dp2_tp2["pp out"])),
        (("pp resumed tp",), functools.partial(tp_losses, case=TpCase(2), disk=disk / "t", load_from=dp2_tp2["pp out"])),
        (("cut plain",), functools.partial(tp_losses, case=TpCase(2, plan="disk"), disk=disk / "a", load_from=plain)),
        (("cut pp",), functools.partial(tp_losses, case=TpCase(2), disk=disk / "b", load_from=dp2_tp2["pp whole"]))]
    jobs += [(("refused", key), functools.partial(refused, disk=disk / "x", **{key: 2})) for key in ("ep", "shard_group")]
    return {**run_ranks(2, tmp_path_factory.mktemp("tp2"), jobs), "out": out, "plain": plain}


def _check(results, case, world, dp):
    norms: list[float] = []
    want = reference(dp, 1, case.clip, tied=case.tied, family=case.family, norms=norms)
    for rank in range(world):
        got = results[((case,), rank)]
        assert got.get("norms", []) == pytest.approx(norms, rel=RTOL, abs=0), f"rank {rank}: the norm over every shard"
        assert got["replica"] == rank // case.tp and got["tp_rank"] == rank % case.tp
        mine = [step[got["replica"]] for step in want]
        assert got["losses"][0] == pytest.approx(mine[0], rel=RTOL, abs=0), f"rank {rank}"
        flat = [x for step in got["losses"] for x in step]
        assert flat == pytest.approx([x for step in mine for x in step], rel=RTOL, abs=0), f"rank {rank}"
        assert len(set(flat)) == len(flat)  # the model moved at every step


@pytest.mark.parametrize("case", TP2, ids=str)
def test_two_ranks_of_tensor_parallel_train_as_one_process(tp2, case):
    _check(tp2, case, 2, 1)


def _delayed(family: str, dp: int) -> list[list[list[float]]]:
    """One process of plain PyTorch updating a step late (``DelayedAdamW``), the replicas' gradients averaged."""
    model, _ = fresh(family=family)
    return reference(dp, 1, start=(model, DelayedAdamW(model)))


def _check_lagged(results, case, world: int, dp: int) -> None:
    """Each rank's losses are one process's updating a step late (within the tolerance above; a free loop's
    lag, or none, moves them by 1e-3 or more), and the parameters every rank holds whole (norms) come out
    the same on all of them, bit for bit."""
    want = _delayed(case.family, dp)
    for rank in range(world):
        got = results[((case,), rank)]
        mine = [x for step in want for x in step[got["replica"]]]
        assert [x for step in got["losses"] for x in step] == pytest.approx(mine, rel=RTOL, abs=0), f"rank {rank}"
    whole = [results[((case,), rank)]["whole"] for rank in range(world)]
    assert whole[0] and all(w.keys() == whole[0].keys() for w in whole)
    assert all(torch.equal(w[k], whole[0][k]) for w in whole[1:] for k in whole[0])


@pytest.mark.parametrize("case", LAGGED, ids=str)
def test_lockfree_at_a_lag_of_one_step_reads_one_age_on_every_rank_of_a_group(tp2, case):
    """Lockfree's default lag in a group runs at a fixed lag."""
    _check_lagged(tp2, case, 2, 1)


def test_lockfree_at_a_fixed_lag_over_sharded_replicas_of_a_group_reads_one_age_everywhere(dp2_tp2):
    """dp = 2 x tp = 2, each block's shards sharded over the two replicas (a free loop's lag is refused there):
    every rank publishes its shard before the block's next use waits for it, and trains a step late."""
    _check_lagged(dp2_tp2, DP2_LAGGED, 4, 2)


@pytest.mark.parametrize("case", DP2_TP2, ids=str)
def test_two_replicas_of_two_tensor_parallel_ranks_train_as_one_process_averaging_them(dp2_tp2, case):
    _check(dp2_tp2, case, 4, 2)


@pytest.mark.parametrize("case", DP4_TP2, ids=str)
def test_four_replicas_of_two_tensor_parallel_ranks_shard_over_pairs_or_divide_experts_and_train_as_one_process(
        dp4_tp2, case):
    _check(dp4_tp2, case, 8, 4)


def test_a_closed_run_leaves_no_process_group_its_meshes_made(dp4_tp2):
    """The dp x tp mesh and the meshes its data-parallel group is split again in (hybrid sharding's, expert
    parallel's) are destroyed as the run closes: a process running many leaves none behind."""
    for case in DP4_TP2:
        assert [dp4_tp2[(("left", case), rank)] for rank in range(8)] == [0] * 8, case


@pytest.mark.parametrize("case", PP2_DP4, ids=str)
def test_a_pipelines_stages_sharded_over_pairs_of_their_replicas_train_as_one_process(dp4_tp2, case):
    """pp = 2 x dp = 4 with hybrid sharding inside each stage's data-parallel group (dp 4 split into 2 x 2
    inside the dp x pp mesh): each stage's DP.sync is a reduce-scatter inside its pair and the shard's
    all-reduce across, once a step, under 1F1B (disk-homed, clipped) and AIAO (two segments, each synced as
    its backward ends); every replica's micro-batch losses are one process's within the tolerance (a
    four-way sum in two steps)."""
    want = reference(4, case.micro, case.clip)
    for rank in range(8):
        got = dp4_tp2[(("pp", case), rank)]
        assert got["replica"] == rank // 2
        mine = [step[got["replica"]] for step in want]
        flat = [x for step in got["losses"] for x in step]
        assert flat == pytest.approx([x for step in mine for x in step], rel=RTOL, abs=0), f"rank {rank}"
        assert len(set(flat)) == len(flat)  # the model moved at every step


@pytest.mark.parametrize("fixture,world,case", [("dp2_tp2", 4, DP2_TP2[-1]), ("dp4_tp2", 8, DP4_TP2[1])])
def test_expert_parallel_inside_tensor_parallel_ranks_holds_its_replicas_experts_cut_and_exchanges_tokens(
        request, fixture, world, case):
    """ep x tp: each replica holds the experts of its place in its expert group (replicas 0 and 2 experts 0
    and 1 of 4, replicas 1 and 3 experts 2 and 3), each cut over its tensor-parallel group as a dense MLP is,
    and every rank sends the tokens its replica routed elsewhere (a group's ranks hold the same tokens)."""
    results = request.getfixturevalue(fixture)
    for rank in range(world):
        got = results[((case,), rank)]
        held, sent = got["experts"]
        assert held == [2 * (got["replica"] % case.ep), 2 * (got["replica"] % case.ep) + 1], rank
        assert sent > 0 and results[((case,), rank ^ 1)]["experts"][1] == sent, rank  # its tp peer sent as much
        assert got["shapes"][f"blocks.0.ffn.experts.{held[0]}.fc.weight"] == (TINY["d_ffn"] // 2, TINY["d_model"])


@pytest.mark.parametrize("fixture,world,sync", [("tp2", 2, ("saved",)), ("dp2_tp2", 4, (TpCase(2, plan="disk"),))])
def test_lockfree_at_staleness_zero_trains_as_sync_bit_for_bit_in_a_group(request, fixture, world, sync):
    """Lockfree's update loops at max staleness 0: every block waits for its own update before it is used,
    on every rank of a tensor-parallel group alike, so the group reads each block at one age and the
    parameters each rank holds whole stay one; the losses are the sync run's (disk-homed), bit for bit."""
    results = request.getfixturevalue(fixture)
    for rank in range(world):
        got = results[((TpCase(2, plan="disk", update="lockfree", staleness=0),), rank)]["losses"]
        assert got == results[(sync, rank)]["losses"], f"rank {rank}"


def test_train_tp_takes_lockfree_at_a_lag_of_one_step_at_most(tmp_path):
    """`train --tp --update lockfree` passes the checks made before torchrun starts at its default lag (1: a
    fixed lag) and at 0, and is refused at 2, given or a plan file's, naming --max-staleness 1 or 0."""
    import dataclasses

    from tiertrain.cli.main import _check_tensor_layout
    from tiertrain.errors import ConfigError
    from tiertrain.plan import builtin_plan
    from tiertrain.train.config import make_config

    args = {"model": "tiny", "plan": "stream", "tp": 2, "update": "lockfree"}
    for lag in (None, 0, 1):
        _check_tensor_layout(make_config({}, {**args, "max_staleness": lag}), 2)
    with pytest.raises(ConfigError, match="max staleness 2 lets each rank .* give --max-staleness 1 .* or 0"):
        make_config({}, {**args, "max_staleness": 2})
    for lag in (1, 2):
        path = tmp_path / f"lag{lag}.json"
        path.write_text(dataclasses.replace(builtin_plan("stream", 4), update="lockfree", max_staleness=lag).to_json())
        cfg = make_config({}, {**args, "plan": str(path), "update": None})
        if lag > 1:
            with pytest.raises(ConfigError, match="max staleness 2 lets each rank .* give max_staleness=1 .* or 0"):
                _check_tensor_layout(cfg, 2)
        else:
            _check_tensor_layout(cfg, 2)


def _counts(case: TpCase) -> tuple[int, int, int, int, int]:
    """The test model's parameters: one block's the group cuts outside its experts, one block's every rank
    holds whole, those outside the blocks (a tied head's weight is the embedding's: counted once), the
    padding their chunks may add (each tensor aligned, each chunk's end), and a rank's share of one block's
    experts (their matrices cut in two, a row-parallel bias whole)."""
    from pp_harness import fresh

    from tiertrain.memory.layout import DEFAULT_ALIGN, TENSOR_ALIGN
    from tiertrain.parallel.tensor_plans import check_tensor_parallel, split_of

    model, _ = fresh(case.tied, case.family)
    at = check_tensor_parallel(model, case.tp).blocks_at
    params = list(model.named_parameters())
    block = [(n, p.numel()) for n, p in params if n.startswith(f"{at}.0.") and ".experts." not in n]
    cut, whole = (sum(k for n, k in block if bool(split_of(n)) == c) for c in (True, False))
    experts = sum(p.numel() // (2 if split_of(n) else 1) for n, p in params  # a rank's share: cut in 2
                  if n.startswith(f"{at}.0.") and ".experts." in n)
    pad = (len(params) + 1) * TENSOR_ALIGN + 2 * (TINY["n_layer"] + 1) * DEFAULT_ALIGN  # (experts: chunks of their own)
    return cut, whole, sum(p.numel() for n, p in params if not n.startswith(f"{at}.")), pad, experts


@pytest.mark.parametrize("fixture,world", [("tp2", 2), ("dp2_tp2", 4), ("dp4_tp2", 8)])
def test_each_rank_holds_its_share_of_a_blocks_optimizer_states(request, fixture, world):
    """From the memory system's accounting: each rank's states of a block are 1/T of the block's cut
    parameters plus its whole ones (norms, projection biases, a router), the embeddings and head whole,
    all of it split over the replicas (ZeRO-3-like), or over a pair of them (hybrid); under expert
    parallel the rank's experts, 1/T of each, apart (held whole by each of their replicas), within the
    chunks' padding."""
    results = request.getfixturevalue(fixture)
    blocks, replicas = TINY["n_layer"], world // 2  # every test model's
    cases = {"tp2": TP2, "dp2_tp2": DP2_TP2, "dp4_tp2": DP4_TP2}[fixture]
    for rank in range(world):
        for case in (c for c in cases if c.plan != "resident"):  # (no masters apart)
            cut, whole, rest, pad, experts = _counts(case)
            got = results[((case,), rank)]
            for kind, nbytes in got["states"].items():
                mine = nbytes // 4  # fp32 states
                want = (blocks * (cut // 2 + whole) + rest) // (case.shard_group or replicas)
                want += blocks * experts // (case.ep if case.ep > 1 else replicas)
                assert want <= mine < want + pad, (rank, case, kind)


def test_each_rank_sends_four_sums_of_a_blocks_activations_per_step_five_where_recomputed(tp2):
    """Bytes each rank's tensor-parallel group sent per step, against the formula: per block, two all-reduces
    of (rows x tokens x d_model) fp32 activations forward, two backward, and a recomputed block's attention
    sum again (torch's checkpoint stops recomputing at the last tensor backward needs, which the MLP's sum
    is past); a ring all-reduce of B bytes sends 2 (T-1)/T x B; a clipping step adds the norm (one fp32).
    With experts, each expert sums its own tokens' outputs and input gradients: top_k tokens' worth each
    way in place of the MLP's one (the router's input, whole, is not entered); recomputed, the experts'
    outputs are summed again (backward weighs each by its gate). With sequence parallel each all-reduce is
    an all-gather and a reduce-scatter, (T-1)/T of the activations each; backward gathers attention's and
    the MLP's input again (the column layers kept their slices: Megatron's); a recompute gathers attention's
    input, scatters its output and gathers the MLP's input again; the sequence is sliced as the first
    block begins (its gradient gathered) and gathered before the final norm; and each block's whole
    parameters' gradients are summed over the group (each rank saw its slice of the tokens). A mixture of
    experts under sequence parallel runs whole: its input gathered, its experts' sums as without slices,
    its output sliced (its gradient gathered), a recompute gathering and summing again; its router's and
    biases' gradients are whole already (not summed)."""
    from pp_harness import MOE, ROWS

    act = ROWS * 16 * TINY["d_model"] * 4  # every test model is 32 wide
    blocks = TINY["n_layer"]
    for case in TP2:
        stash, moe, k = case.plan == "stash", case.family == "moe", MOE["top_k"]
        unit = (case.tp - 1) * act // case.tp  # an all-gather's or a reduce-scatter's bytes; an all-reduce: two
        if case.sequence and moe:
            whole = _whole_outside_ffn(case) * 4 * 2 * (case.tp - 1) // case.tp
            want = blocks * ((7 + 4 * k + stash * (3 + 2 * k)) * unit + whole) + 2 * unit
        elif case.sequence:
            whole = _counts(case)[1] * 4 * 2 * (case.tp - 1) // case.tp
            want = blocks * ((10 + 3 * stash) * unit + whole) + 2 * unit
        else:
            want = blocks * 2 * (4 + stash + (2 * k - 2 + stash * k if moe else 0)) * unit
        want += 4 if case.clip else 0
        for rank in range(2):
            assert tp2[((case,), rank)]["sent"] == [want] * 3, (case, rank)


def _whole_outside_ffn(case: TpCase) -> int:
    """A block's parameters every rank holds whole outside its feed-forward (norms, attention's projection bias)."""
    from pp_harness import fresh

    from tiertrain.parallel.tensor_plans import split_of

    model, _ = fresh(case.tied, case.family)
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith("blocks.0.") and not n.startswith("blocks.0.ffn.") and not split_of(n))


def test_sequence_parallel_keeps_a_slice_of_each_norms_input_for_backward(tp2):
    """What autograd saves in a forward (a resident plan: nothing between the blocks and autograd): with the
    sequence sliced, each of a block's two norms keeps its input's slice, not the whole sequence, and so do
    the two column layers reading the gathered sequence (they gather it again in backward), so a rank
    saves at least 4 x blocks x half an activation less."""
    from pp_harness import ROWS

    act = ROWS * 16 * TINY["d_model"] * 4
    for rank in range(2):
        whole, sliced = (tp2[((TpCase(2, plan="resident", sequence=s),), rank)]["saved"] for s in (False, True))
        assert 0 < sliced <= whole - 4 * TINY["n_layer"] * act // 2, (rank, whole, sliced)


@pytest.mark.parametrize("transposed,bias,autocast", [(False, True, False), (False, False, False),
                                                       (True, True, False), (True, False, False),
                                                       (False, True, True), (True, True, True)])
def test_column_layers_reading_a_gathered_sequence_save_its_slice_and_gather_it_once_again_in_backward(
        transposed, bias, autocast):
    """Three column layers reading one gathered sequence (q, k and v): each saves the slice, not the whole;
    backward gathers the whole once for the three; outputs and gradients bit for bit autograd's F.linear
    (one rank's group: the gather is a copy, counted); under bf16 autocast with an fp32 slice too (a norm
    autocast keeps in fp32 on a GPU)."""
    from tiertrain.parallel.local import LocalCollectives
    from tiertrain.parallel.sequence_ops import enter_sequence
    from tiertrain.parallel.tensor_layers import ColumnParallelLinear

    class Counted(LocalCollectives):
        gathers = 0

        def all_gather(self, out, shard, async_op=False):
            Counted.gathers += 1
            return super().all_gather(out, shard, async_op)

    torch.manual_seed(0)
    group, w = Counted(), torch.randn(*((32, 48) if transposed else (48, 32)))
    b = torch.randn(48) if bias else None
    results = []
    for regather in (True, False):
        layers = [ColumnParallelLinear(w.clone(), None if b is None else b.clone(), group, False, transposed)
                  for _ in range(3)]
        x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        saved: list[torch.Tensor] = []
        with (torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
            part = x * 2  # fp32 either way
            whole = enter_sequence(part, group)
            if not regather:
                whole.gathered_from = None  # autograd's F.linear, saving the whole
            loss = sum((layer(whole).float() ** 2).sum() for layer in layers)
        Counted.gathers = 0
        loss.backward()
        if not autocast:  # (autocast saves cast copies: what is saved is told apart by data in fp32 only)
            slices = sum(t.data_ptr() == part.data_ptr() for t in saved)
            wholes = sum(t.numel() == whole.numel() and t.data_ptr() != part.data_ptr() for t in saved)
            assert (slices, wholes) == ((3, 0) if regather else (0, 3))  # (F.linear saves a 2-D copy of the whole)
        results.append((loss, x.grad, *[p.grad for layer in layers for p in layer.parameters()], Counted.gathers))
    (*mine, gathers), (*plain, none) = results
    assert all(torch.equal(a, c) for a, c in zip(mine, plain))
    assert (gathers, none) == (1, 0)


def test_the_shards_are_the_ranks_heads_and_features():
    """Rank r's qkv rows are its heads' rows of q, of k and of v; fc's its output features, the projections'
    its input features; merging every rank's shards gives the tensor back."""
    from tiertrain.parallel.tensor_layers import COLUMNS, ROWS, Split
    from tiertrain.parallel.tensor_plans import split_of

    QKV = split_of("blocks.3.attn.qkv.weight")
    assert QKV == split_of("transformer.h.0.attn.c_attn.bias") == Split(0, 3)
    assert split_of("transformer.h.0.attn.c_attn.weight") == Split(1, 3)  # Conv1D's [in, out]: q, k, v columns
    assert split_of("transformer.h.0.mlp.c_proj.weight") == Split(0) and split_of("transformer.h.0.mlp.c_proj.bias") is None
    assert split_of("gpt_neox.layers.1.attention.query_key_value.weight") == COLUMNS  # head by head: plain rows
    assert split_of("blocks.0.ffn.experts.3.proj.weight") == ROWS and split_of("blocks.0.ffn.router.weight") is None
    d, tp = 8, 2
    w = torch.arange(3 * d * d, dtype=torch.float32).reshape(3 * d, d)
    shards = [QKV.shard(w, r, tp) for r in range(tp)]
    half = d // tp
    for r, s in enumerate(shards):
        assert s.shape == (3 * half, d)
        for part in range(3):  # q, k, v
            assert torch.equal(s[part * half:(part + 1) * half], w[part * d + r * half:part * d + (r + 1) * half])
    assert torch.equal(QKV.merge(shards), w)
    m = torch.randn(6, 4)
    assert torch.equal(COLUMNS.merge([COLUMNS.shard(m, r, 2) for r in range(2)]), m)
    assert torch.equal(ROWS.shard(m, 1, 2), m[:, 2:])


@pytest.mark.parametrize("change,words", [
    ({"n_head": 3, "d_model": 33}, "--tp 2 must divide the model's attention heads (n_head), 3"),
    ({"d_ffn": 63}, "--tp 2 must divide the model's MLP features (d_ffn), 63"),
    ({"dropout": 0.1}, "tensor parallel needs dropout 0"),
])
def test_a_model_the_plan_cannot_cut_is_refused_in_one_line(change, words):
    import tiertrain
    from tiertrain.errors import ConfigError
    from tiertrain.models import build
    from tiertrain.train.optimizer import make_adamw

    model = build({**TINY, **change})
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        tiertrain.tensor_parallel(model, opt, 2)
    assert all(p.shape == q.shape for p, q in zip(model.parameters(), build({**TINY, **change}).parameters()))


def test_an_architecture_without_a_plan_and_plan_auto_are_refused_before_any_group_is_made():
    from pp_harness import LLAMA, fresh

    import tiertrain
    from tiertrain.errors import ConfigError
    from tiertrain.models import build
    from tiertrain.train.optimizer import make_adamw

    opt_model = build({"model_type": "opt", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "ffn_dim": 64, "word_embed_proj_dim": 32})
    opt, _ = make_adamw(opt_model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    with pytest.raises(ConfigError, match="parallelize plan for tiertrain's GPT .* llama, qwen2, mistral, gpt2, "
                                          "gpt_neox only; got OPTForCausalLM"):
        tiertrain.tensor_parallel(opt_model, opt, 2)
    gpt2 = build({"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2})
    opt, _ = make_adamw(gpt2, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    with pytest.raises(ConfigError, match=r"tensor parallel needs dropout 0 \(got 0.1\)"):
        tiertrain.tensor_parallel(gpt2, opt, 2)
    llama = build({**LLAMA, "num_key_value_heads": 1})
    opt, _ = make_adamw(llama, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    with pytest.raises(ConfigError, match=r"must divide the model's key-value heads \(num_key_value_heads\), 1"):
        tiertrain.tensor_parallel(llama, opt, 2)
    model, opt = fresh()
    with pytest.raises(ConfigError, match="not plan 'auto'"):
        tiertrain.tensor_parallel(model, opt, 2, plan="auto")
    with pytest.raises(ConfigError, match="the lockfree update mode with max staleness 3 lets each rank read "
                                          "params of another age.* give max_staleness=1 .* or 0"):
        tiertrain.tensor_parallel(model, opt, 2, update="lockfree", max_staleness=3)
    with pytest.raises(ConfigError, match="not fp16: use bf16"):
        tiertrain.tensor_parallel(model, opt, 2, compute_dtype="fp16")
    with pytest.raises(ConfigError, match="--tp 2 must divide the run's 1 ranks"):
        tiertrain.tensor_parallel(model, opt, 2)
    assert not torch.distributed.is_initialized()


def test_expert_parallel_or_hybrid_sharding_over_a_group_without_replicas_is_refused_naming_why(tp2):
    """tp = 2 on two ranks leaves one data-parallel replica: ep or shard_group over replicas is refused on every
    rank in one line that says so (not "launch it under torchrun": it runs under it)."""
    for key, what in (("ep", "expert parallel ep=2"), ("shard_group", "hybrid sharding (shard_group=2)")):
        for rank in range(2):
            said = tp2[(("refused", key), rank)]
            assert said.startswith(what) and "has one data-parallel replica (its 2 ranks are a tensor-parallel" in said


def _plain_from(ckpt_dir, family: str = "gpt"):
    """One process of plain PyTorch (the whole model, torch's AdamW) from a tensor-parallel checkpoint."""
    from pp_harness import fresh

    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    model, opt = fresh(family=family)
    state = load_checkpoint(find_checkpoint(ckpt_dir), PlainState(model, opt, _names(model)))
    return model, opt, state


def _names(model) -> dict[int, str]:
    """The optimizer's parameters' names by index: make_adamw's decayed matrices first, then the rest."""
    params = list(model.named_parameters())
    return dict(enumerate([n for n, p in params if p.dim() >= 2] + [n for n, p in params if p.dim() < 2]))


@pytest.mark.parametrize("fixture,world", [("tp2", 2), ("dp2_tp2", 4)])
def test_a_tensor_parallel_checkpoint_resumes_in_one_process_of_plain_pytorch(request, fixture, world):
    """Saved at tp = 2 (each rank's shards one process's files) and at dp = 2 x tp = 2 (each rank's shards
    sharded over its two replicas) after step 1: the shards put back together load into one process's
    model and AdamW, and its steps 2 and 3 are the tensor-parallel run's."""
    results = request.getfixturevalue(fixture)
    model, opt, state = _plain_from(results["out"])
    assert (state.step, state.world) == (1, world)
    want = reference(world // 2, 1, start=(model, opt), first=state.step)
    for rank in range(world):
        got = results[(("saved",), rank)]
        flat = [x for step in got["losses"][1:] for x in step]
        assert flat == pytest.approx([step[got["replica"]][0] for step in want], rel=RTOL, abs=0), f"rank {rank}"


def test_an_expert_and_tensor_parallel_checkpoint_resumes_in_one_process_of_plain_pytorch(dp2_tp2):
    """Saved at dp = 2 x tp = 2 with each replica holding half the experts, each cut over its group, after
    step 1: every expert's shards put back together load into one process, whose steps 2 and 3 are the run's."""
    model, opt, state = _plain_from(dp2_tp2["ep out"], family="moe")
    assert (state.step, state.world) == (1, 4)
    want = reference(2, 1, start=(model, opt), first=state.step)
    for rank in range(4):
        got = dp2_tp2[(("ep saved",), rank)]
        flat = [x for step in got["losses"][1:] for x in step]
        assert flat == pytest.approx([step[got["replica"]][0] for step in want], rel=RTOL, abs=0), f"rank {rank}"


def test_a_checkpoint_of_two_replicas_resumes_at_one_replica_of_the_same_group(tp2, dp2_tp2):
    """Saved at dp = 2 x tp = 2, resumed at tp = 2 alone: each rank reads its own shards out of its
    sub-checkpoint (sharded over the saved replicas), and trains on as one process from that checkpoint does."""
    model, opt, state = _plain_from(dp2_tp2["out"])
    want = [step[0][0] for step in reference(1, 1, start=(model, opt), first=state.step)]
    for rank in range(2):
        got = [step[0] for step in tp2[(("resumed",), rank)]["losses"]]
        assert got == pytest.approx(want, rel=RTOL, abs=0), f"rank {rank}"


def test_a_tensor_parallel_checkpoint_resumes_as_one_tiered_process(tp2, tmp_path):
    """tp = 2's checkpoint resumed by one process under tiertrain.setup (tp = 1, the disk plan): its steps
    2 and 3 are the tensor-parallel run's."""
    from conftest import train_losses
    from pp_harness import _plan, batches, fresh

    import tiertrain
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import TieredState
    from tiertrain.memory import Budgets

    model, opt = fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path)),
                               plan=_plan("disk", TINY["n_layer"]), page_size=64 << 10)
    first = load_checkpoint(find_checkpoint(tp2["out"]), TieredState(tm)).step
    losses = train_losses(tm, topt, batches(0)[first:])
    saved = [step[0] for step in tp2[(("saved",), 0)]["losses"][1:]]
    assert first == 1 and losses == pytest.approx(saved, rel=RTOL, abs=0)


@pytest.mark.parametrize("case", PP2_TP2, ids=str)
def test_a_pipeline_of_two_stages_each_cut_over_two_ranks_trains_as_one_process(dp2_tp2, case):
    """pp = 2 x tp = 2: each stage's blocks cut over its two ranks, under 1F1B and AIAO (2 segments), with
    host- and disk-homed states and recompute with offloaded checkpoints, our GPT (experts too) and the
    transformers families, the sequence sliced too: each micro-batch's loss, and each clipped step's norm over
    every stage and shard, as one process accumulating the same micro-batches."""
    norms: list[float] = []
    want = reference(1, case.micro, case.clip, family=case.family, norms=norms)
    for rank in range(4):
        got = dp2_tp2[(("pp", case), rank)]
        assert got["replica"] == 0 and got["pp_rank"] == (rank // 2) % 2, rank
        flat = [x for step in got["losses"] for x in step]
        assert flat == pytest.approx([x for step in want for x in step[0]], rel=RTOL, abs=0), f"rank {rank}"
        assert got["norms"] == pytest.approx(norms, rel=RTOL, abs=0), f"rank {rank}"


def test_sequence_parallel_in_a_pipeline_sends_what_slicing_adds_to_tensor_parallel(dp2_tp2):
    """pp = 2 x tp = 2 with the sequence sliced, beside the same run without: each rank's group sends, a
    step, for each micro-batch and each of its stage's blocks the two column inputs gathered again backward
    and the whole parameters' gradient sums; the first stage gathers the slices' gradient backward, the last
    the slices before the final norm (an all-gather of a micro-batch's activations, (T-1)/T of them, each)."""
    from pp_harness import ROWS, TINY

    micro = 2
    unit = ROWS // micro * 16 * TINY["d_model"] * 4 // 2  # a micro-batch's rows x tokens x d fp32, (T-1)/T of it
    whole = _counts(TpCase(2))[1] * 4 * 2 // 2  # a block's whole fp32 gradients all-reduced: 2 (T-1)/T of them
    blocks = TINY["n_layer"] // 2
    for rank in range(4):
        plain = dp2_tp2[(("pp", Case("1f1b", micro, 1, clip=0.05)), rank)]["tp_sent"]
        sliced = dp2_tp2[(("pp", Case("1f1b", micro, 1, clip=0.05, sequence=True)), rank)]["tp_sent"]
        extra = micro * (blocks * (2 * unit + whole) + unit)
        assert [s - p for s, p in zip(sliced, plain)] == [extra] * 3, rank


def test_a_transformers_models_later_stage_gathers_its_slices_to_build_its_mask_and_slices_them_again(dp2_tp2):
    """A Llama at pp = 2 x tp = 2 with the sequence sliced: its slices cross between the stages, and the last
    stage gathers them whole before its base model builds the causal mask and rotary tables (the whole
    sequence's, as the first stage's), then slices them again at its first layer (each gradient gathered):
    beside the first stage's bytes, two all-gathers of a micro-batch's activations more (its losses are one
    process's: ``test_a_pipeline_of_two_stages_each_cut_over_two_ranks_trains_as_one_process``)."""
    from pp_harness import ROWS, TINY

    micro = 2
    unit = ROWS // micro * 16 * TINY["d_model"] * 4 // 2
    whole = _counts(TpCase(2, family="llama"))[1] * 4 * 2 // 2
    blocks = TINY["n_layer"] // 2
    for rank in range(4):
        plain = dp2_tp2[(("pp", Case("1f1b", micro, 1, clip=0.05, family="llama")), rank)]
        sliced = dp2_tp2[(("pp", Case("1f1b", micro, 1, clip=0.05, family="llama", sequence=True)), rank)]
        later = sliced["pp_rank"] == 1
        extra = micro * (blocks * (2 * unit + whole) + unit + 2 * unit * later)
        assert [s - p for s, p in zip(sliced["tp_sent"], plain["tp_sent"])] == [extra] * 3, rank


def test_a_pipeline_cut_over_tensor_parallel_ranks_saves_and_resumes_at_another_layout(tp2, dp2_tp2):
    """Saved at pp = 2 x tp = 2 after step 1 (each tensor-parallel rank's part a pipelined checkpoint of its
    shards): resumed by pp = 2 alone (AIAO, 4 stages: each stage's shards put back together), by tp = 2
    alone (each rank's shards out of both stages), at its own layout (each rank its own shards of its own
    stage), and by one process of plain PyTorch; each goes on with the losses one process takes from that
    checkpoint, and the saved run's own."""
    model, opt, state = _plain_from(dp2_tp2["pp out"])
    assert (state.step, state.world) == (1, 4)
    want = [step[0][0] for step in reference(1, 1, start=(model, opt), first=state.step)]
    saved = dp2_tp2[(("pp saved",), 0)]["losses"]
    assert [sum(step) for step in saved[1:]] == pytest.approx(want, rel=RTOL, abs=0)
    for rank in range(4):
        same = [sum(step) for step in dp2_tp2[(("pp same",), rank)]["losses"]]
        assert same == pytest.approx(want, rel=RTOL, abs=0), f"rank {rank}"
    for rank in range(2):
        piped = [sum(step) for step in tp2[(("pp resumed",), rank)]["losses"]]
        assert piped == pytest.approx(want, rel=RTOL, abs=0), f"rank {rank}"
        cut = [step[0] for step in tp2[(("pp resumed tp",), rank)]["losses"]]
        assert cut == pytest.approx(want, rel=RTOL, abs=0), f"rank {rank}"


@pytest.mark.parametrize("source", ["plain", "pp whole"])
def test_a_checkpoint_saved_whole_resumes_cut_over_tensor_parallel_ranks(tp2, dp2_tp2, source):
    """Saved by one process of plain PyTorch, and by pp = 2 x dp = 2 without tensor parallel (each stage's
    states sharded over its two replicas): resumed at tp = 2, each tensor checked against the whole
    model's shape and cut for the reader's rank; the run goes on as one process from that checkpoint."""
    model, opt, state = _plain_from(tp2["plain"] if source == "plain" else dp2_tp2[source])
    assert state.step == 1
    want = [step[0][0] for step in reference(1, 1, start=(model, opt), first=state.step)]
    job = "cut plain" if source == "plain" else "cut pp"
    for rank in range(2):
        got = [step[0] for step in tp2[((job,), rank)]["losses"]]
        assert got == pytest.approx(want, rel=RTOL, abs=0), f"rank {rank}"


def test_a_tied_pipeline_cut_over_tensor_parallel_ranks_is_refused_before_any_group_is_made(monkeypatch):
    from pp_harness import fresh

    import tiertrain
    from tiertrain.errors import ConfigError
    from tiertrain.plan.pipeline import PipelineLayout

    monkeypatch.setenv("WORLD_SIZE", "4")
    model, opt = fresh(tied=True)
    with pytest.raises(ConfigError, match="tied embedding in a pipeline cut over tensor-parallel ranks"):
        tiertrain.pipeline(model, opt, PipelineLayout(2, "1f1b", 2, 1), tp=2)
    model, opt = fresh()
    with pytest.raises(ConfigError, match="--pp 2 x --tp 3 must divide the run's 4 ranks"):
        tiertrain.pipeline(model, opt, PipelineLayout(2, "1f1b", 2, 1), tp=3)
    assert not torch.distributed.is_initialized()


def test_a_model_built_on_the_meta_device_is_drawn_whole_by_the_group_and_cut(tp2):
    """Built on the meta device (as train builds a model larger than the host), each ranks' generators set
    apart: each matrix is drawn whole from the group's seed and the parameter's name and cut, so the two
    ranks' shards put together are that one matrix (not the same numbers twice, nor two draws); the whole
    parameter let go once cut (no rank keeps every block's matrices); the whole ones equal; both train alike."""
    from tp_harness import META_SEED

    from tiertrain.parallel.tensor_plans import split_of
    from tiertrain.parallel.tensor_start import drawn_whole

    a, b = tp2[((META,), 0)], tp2[((META,), 1)]
    d = TINY["d_model"]
    assert a["qkv"].shape == (3 * d // 2, d) and not torch.equal(a["qkv"], b["qkv"])
    whole = torch.nn.Parameter(torch.empty(3 * d, d, device="meta"))
    drawn_whole("blocks.0.attn.qkv.weight", whole, META_SEED)
    assert torch.equal(split_of("blocks.0.attn.qkv.weight").merge([a["qkv"], b["qkv"]]), whole.detach())
    assert a["let_go"] == b["let_go"] == [True]
    assert torch.equal(a["ln1"], b["ln1"]) and torch.equal(a["emb"], b["emb"])
    assert a["losses"] == b["losses"] and len({x for step in a["losses"] for x in step}) == 3
    a, b = tp2[((META_MOE,), 0)], tp2[((META_MOE,), 1)]  # a router is whole: every rank routes alike
    assert torch.equal(a["router"], b["router"]) and a["router"].std() > 0.01
    assert a["losses"] == b["losses"] and len({x for step in a["losses"] for x in step}) == 3


def test_a_plan_files_update_mode_is_refused_as_a_given_one_and_train_takes_what_plan_tp_writes(tmp_path, capsys):
    """A lockfree plan file lagging two steps is refused by the Python entry and by `train --tp` before torchrun
    starts; the plan `tiertrain plan --nproc 4 --tp 2` writes (laid out for the 2 replicas) passes train's
    layout check."""
    import dataclasses

    from pp_harness import fresh

    import tiertrain
    from tiertrain.cli.main import main
    from tiertrain.errors import ConfigError
    from tiertrain.plan import builtin_plan

    lockfree = tmp_path / "lockfree.json"
    lockfree.write_text(dataclasses.replace(builtin_plan("stream", 4), update="lockfree", max_staleness=2).to_json())
    model, opt = fresh()
    with pytest.raises(ConfigError, match="the lockfree update mode"):
        tiertrain.tensor_parallel(model, opt, 2, plan=str(lockfree))
    cut = ["train", "--model", "tiny", "--nproc", "2", "--tp", "2", "--out", str(tmp_path / "r")]
    assert main([*cut, "--plan", str(lockfree)]) == 2
    assert "the lockfree update mode" in capsys.readouterr().err
    laid = tmp_path / "laid.json"
    laid.write_text(dataclasses.replace(builtin_plan("stream", 2), parallel=dataclasses.replace(
        builtin_plan("stream", 2).parallel, dp=2)).to_json())
    from tiertrain.cli.main import _check_layout
    from tiertrain.train.config import make_config

    _check_layout(make_config({}, {"model": "tiny", "plan": str(laid), "tp": 2}), 4)  # 2 replicas of 2: taken
    with pytest.raises(ConfigError, match="laid out for 2 ranks but --nproc 2 --tp 2 makes 1"):
        _check_layout(make_config({}, {"model": "tiny", "plan": str(laid), "tp": 2}), 2)


def test_a_tensor_parallel_checkpoint_exports_as_the_whole_models_state_dict(tp2, tmp_path):
    """`tiertrain export` of tp = 2's checkpoint: one state dict of the whole model, each cut tensor put back
    together, equal to what one process loads from the checkpoint."""
    from safetensors.torch import load_file

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.checkpoint.train_state import weights_to_save

    model, _, _ = _plain_from(tp2["out"])
    export_checkpoint(tp2["out"], tmp_path / "x", say=lambda _: None)
    written = load_file(tmp_path / "x" / "model.safetensors")
    want = {n: t for n, t in model.state_dict().items()}
    assert set(written) == set(weights_to_save(model)) and "blocks.0.attn.qkv.weight" in written
    for name, t in written.items():
        assert torch.equal(t, want[name]), name


def test_a_checkpoint_saved_at_tp_1_over_four_replicas_resumes_cut_over_two_ranks(tp2, dp2_tp2):
    """Saved at tp = 1, dp = 4 (one sub-checkpoint, sharded over four replicas), resumed at tp = 2: each
    tensor read whole, cut for the reader's rank; the run goes on as one process from that checkpoint."""
    model, opt, state = _plain_from(dp2_tp2["tp1 out"])
    assert (state.step, state.world) == (1, 4)
    want = [step[0][0] for step in reference(1, 1, start=(model, opt), first=state.step)]
    for rank in range(2):
        got = [step[0] for step in tp2[(("resumed tp1",), rank)]["losses"]]
        assert got == pytest.approx(want, rel=RTOL, abs=0), f"rank {rank}"
