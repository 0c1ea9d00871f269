"""Tensor parallel in the planner (issue 39): one rank's share of a block and the group's sums in its
times, `plan --tp`, and `plan --max-model` over a cluster's layouts. No process is started: the planner
is pure."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
from test_machines import small_machine

GiB = 1 << 30


def _profile(cfg, machine):
    from tiertrain.measure.analytic import analytic_profile

    return analytic_profile(cfg, 4, 256, "bf16", machine=machine)


def test_a_ranks_profile_holds_its_share_of_each_block_and_waits_for_the_groups_sums():
    """Each block: its cut parameters over T plus its whole ones; its forward and backward times over T
    plus two all-reduces of its output each, a recompute's over T plus one; its saved activations over T
    beyond the five inputs' worth every rank keeps; its FLOPs over T. The rest (embeddings, head) whole.
    The sums cost what the runtime's collectives count: 2 (T-1)/T of the buffer at the link's rate."""
    from tiertrain.models import build
    from tiertrain.models.configs import CONFIGS
    from tiertrain.parallel.tensor_plans import split_of, whole_per_block
    from tiertrain.planner.tensor import WHOLE_INPUTS, all_reduce_s, for_tensor, sums_s

    cfg = CONFIGS["gpt-small"]
    p, tp, bps = _profile(cfg, small_machine()), 4, 1e10
    whole = whole_per_block(cfg)
    model = build(cfg, device="meta")
    assert whole == sum(t.numel() for n, t in model.named_parameters() if n.startswith("blocks.0.") and not split_of(n))
    cut = for_tensor(p, tp, bps, whole)
    assert cut.rest == p.rest and len(cut.blocks) == len(p.blocks)
    for b, c in zip(p.blocks, cut.blocks):
        one = all_reduce_s(b.hidden_bytes, tp, bps)
        assert one == pytest.approx(2 * (tp - 1) / tp * b.hidden_bytes / bps)
        assert c.params == -(-(b.params - whole) // tp) + whole
        assert c.forward_s == pytest.approx(b.forward_s / tp + 2 * one)
        assert c.backward_s == pytest.approx(b.backward_s / tp + 2 * one)
        assert c.recompute_seconds == pytest.approx(b.recompute_seconds / tp + one)
        kept = min(b.act_bytes, WHOLE_INPUTS * b.hidden_bytes)
        assert c.act_bytes == kept + -(-(b.act_bytes - kept) // tp) and c.flops == pytest.approx(b.flops / tp)
    added = sum(c.forward_s + c.backward_s - (b.forward_s + b.backward_s) / tp for b, c in zip(p.blocks, cut.blocks))
    assert sums_s(p, cut, tp) == pytest.approx(added) == pytest.approx(len(p.blocks) * 4 * one) and added > 0
    assert for_tensor(p, 1, bps, whole) is p
    routed = for_tensor(p, tp, bps, whole, routed=2)  # experts, 2 a token: each MLP sum twice the tokens
    for b, c in zip(p.blocks, routed.blocks):
        one = all_reduce_s(b.hidden_bytes, tp, bps)
        assert (c.forward_s, c.backward_s) == pytest.approx((b.forward_s / tp + 3 * one, b.backward_s / tp + 3 * one))
        assert c.recompute_seconds == pytest.approx(b.recompute_seconds / tp + 3 * one)  # the experts' sums again
    added = sum(c.forward_s + c.backward_s - (b.forward_s + b.backward_s) / tp for b, c in zip(p.blocks, routed.blocks))
    assert sums_s(p, routed, tp) == pytest.approx(added)
    sliced = for_tensor(p, tp, bps, whole, sequence=True)  # the norms' and residuals' activations 1/T too, and
    for b, c, s in zip(p.blocks, cut.blocks, sliced.blocks):  # the column layers' inputs, gathered again backward
        assert s.act_bytes == -(-b.act_bytes // tp) < c.act_bytes
        assert (s.hidden_bytes, c.hidden_bytes) == (-(-b.hidden_bytes // tp), b.hidden_bytes)  # a slice in, sent on
        assert (s.forward_s, s.params) == (c.forward_s, c.params)
        one = all_reduce_s(b.hidden_bytes, tp, bps)
        assert s.recompute_seconds == pytest.approx(c.recompute_seconds + 0.5 * one)
        regather = 2 * (tp - 1) / tp * b.hidden_bytes / bps  # two all-gathers of the block's input
        assert s.backward_s == pytest.approx(c.backward_s + all_reduce_s(4 * whole, tp, bps) + regather)
    assert sums_s(p, sliced, tp) == pytest.approx(sums_s(p, cut, tp) + len(p.blocks) * (
        all_reduce_s(4 * whole, tp, bps) + 2 * (tp - 1) / tp * p.blocks[0].hidden_bytes / bps))  # the plan says so
    mixed = for_tensor(p, tp, bps, whole, routed=2, sequence=True, summed=whole // 2)  # experts run whole between
    for b, r, m in zip(p.blocks, routed.blocks, mixed.blocks):  # the slices: their gathered input kept whole, by
        one = all_reduce_s(b.hidden_bytes, tp, bps)  # the router and each of the 2 experts; half a sum more forward
        kept = min(b.act_bytes, 3 * b.hidden_bytes)
        assert m.act_bytes == kept + -(-(b.act_bytes - kept) // tp)
        assert m.forward_s == pytest.approx(r.forward_s + 0.5 * one)
        assert m.backward_s == pytest.approx(r.backward_s + all_reduce_s(4 * (whole // 2), tp, bps) + one)


def _main(*args: str) -> int:
    from tiertrain.cli.main import main

    return main(list(args))


def test_plan_tp_plans_each_ranks_share_and_says_what_the_sums_cost(tmp_path, capsys):
    """`plan --nproc 4 --tp 2` plans a rank of two replicas of a group of two: fewer parameters a rank than
    --tp 1's, and the group's sums named; the plan is laid out for the two replicas."""
    out = tmp_path / "plan.json"
    base = ["plan", "--model", "tiny", "--machine", "h100-sxm-80gb", "--precision", "bf16", "--batch", "4",
            "--seq", "64", "--solver", "dp", "--out", str(out)]
    assert _main(*base, "--nproc", "4", "--tp", "2") == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "2 ranks, each with these budgets" in said
    assert "tensor parallel: --tp 2, each rank" in said and "on the critical path (h100-sxm-80gb's link nvlink4" in said
    assert json.loads(out.read_text())["parallel"] == {"dp": 2, "tp": 2}


def test_plan_tp_plans_lockfree_at_its_default_lag_as_a_fixed_lag_and_counts_its_compute_copies(tmp_path, capsys):
    """`plan --tp 2 --update lockfree` (max staleness 1) writes a plan at a fixed lag, as the group runs it; the
    planner's bytes for it (a streamed fp32 block's compute copy on the host, a device-homed resident block's
    slot apart from its master) are the budget check's, block by block, in whole pages."""
    from tiertrain.plan import Plan, Tier
    from tiertrain.plan.fit import tier_bytes
    from tiertrain.planner.auto import run_profile, to_plan
    from tiertrain.planner.costs import Choice, device_bytes, host_bytes
    from tiertrain.planner.network import Network
    from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
    from tiertrain.planner.solvers import Solution

    out = tmp_path / "plan.json"
    assert _main("plan", "--model", "tiny", "--machine", "h100-sxm-80gb", "--batch", "4", "--seq", "64", "--nproc", "2",
                 "--tp", "2", "--update", "lockfree", "--grad-clip", "0", "--out", str(out)) == 0
    written = Plan.from_json(out.read_text())
    assert (written.update, written.max_staleness, written.fixed_lag) == ("lockfree", 1, True)
    page, n = 4096, 10_000
    blocks = tuple(BlockProfile(f"blocks.{i}", 1e-3, 2e-3, n, 1 << 12, 1 << 10) for i in range(2))
    machine = MachineProfile(h2d_bps=1e10, d2h_bps=1e10, disk_read_bps=1e9, disk_write_bps=1e9, adam_params_per_s=1e9)
    streamed, resident = Choice(True, False, False, False), Choice(False, False, False, True)
    for net, choice in itertools.product((Network(), Network(dp=2, shard=True)), (streamed, resident)):
        base = Profile(blocks, BlockProfile("rest", 1e-4, 2e-4, n, 1 << 12, 1 << 10), machine, page=page, network=net)
        solution = Solution((choice, choice), 2, (False, False), 0.0, "dp")
        need = {}
        for group in (False, True):
            p = run_profile(base, "lockfree", 1, False, group=group)
            plan = to_plan(solution, p, "lockfree", 1)
            assert plan.fixed_lag is group
            need[group] = (tier_bytes([n, n, n], plan, page), sum(device_bytes(p, b, choice) for b in blocks),
                           host_bytes(p, (choice, choice), (False, False)))
        fit_more = {t: need[True][0][t] - need[False][0][t] for t in Tier}
        planner_more = {Tier.DEVICE: need[True][1] - need[False][1], Tier.HOST: need[True][2] - need[False][2]}
        assert fit_more[Tier.DISK] == 0
        for tier in (Tier.DEVICE, Tier.HOST):  # sharded: every block's shard's copy on the host, the rest's too
            assert fit_more[tier] == planner_more[tier], (net.dp, choice, tier)
        where = Tier.DEVICE if choice is resident and not net.parallel else Tier.HOST
        assert fit_more[where] >= 2 * -(-n * 4 // net.dp // page) * page, (net.dp, choice)  # two blocks' copies


def test_plan_tp_with_ep_plans_each_rank_with_its_experts_shards(tmp_path, capsys):
    """`plan --nproc 8 --tp 2 --ep 2`: four replicas of a group of two, each holding half the experts, each
    expert cut over the group as a dense MLP is: a rank's share of a block is half its matrices (and whole
    norms, routers, row-parallel biases) outside the experts and a quarter of the experts' (within the
    chunks' padding); the file is laid out so."""
    from tiertrain.memory.layout import DEFAULT_ALIGN, TENSOR_ALIGN
    from tiertrain.models import build, resolve_config
    from tiertrain.parallel.tensor_plans import (
        check_tensor_parallel,
        split_of,
        summed_in_a_block,
        whole_in_a_block,
    )

    out = tmp_path / "plan.json"
    assert _main("plan", "--model", "tiny-moe", "--machine", "h100-sxm-80gb", "--batch", "2", "--seq", "32",
                 "--solver", "dp", "--nproc", "8", "--tp", "2", "--ep", "2", "--out", str(out)) == 0
    said = " ".join(capsys.readouterr().out.split())
    got = int(re.search(r"each rank ([\d,]+) of a block's", said).group(1).replace(",", ""))
    block = [(n, p.numel()) for n, p in build(resolve_config("tiny-moe"), device="meta").named_parameters()
             if n.startswith("blocks.0.")]
    share = [k // (2 if split_of(n) else 1) // (2 if ".experts." in n else 1) for n, k in block]
    assert sum(share) <= got < sum(share) + 2 * (len(block) * TENSOR_ALIGN + DEFAULT_ALIGN), said
    assert json.loads(out.read_text())["parallel"] == {"dp": 4, "ep": 2, "tp": 2}
    moe = build(resolve_config("tiny-moe"), device="meta")  # under sequence parallel the mixture runs whole: its
    cut = check_tensor_parallel(moe, 2)                      # router's and biases' gradients are not summed
    outside = sum(k for n, k in block if not split_of(n) and not n.startswith("blocks.0.ffn."))
    assert summed_in_a_block(moe, cut) == outside < whole_in_a_block(moe, cut)
    assert _main("plan", "--model", "tiny-moe", "--machine", "h100-sxm-80gb", "--batch", "2", "--seq", "32", "--solver",
                 "dp", "--nproc", "2", "--tp", "2", "--sequence-parallel", "--out", str(out)) == 0  # experts sliced too
    assert json.loads(out.read_text())["parallel"] == {"dp": 1, "tp": 2, "sequence_parallel": True}


def test_a_plan_file_says_the_cut_it_was_made_for_and_train_refuses_another(tmp_path, capsys):
    """`plan --nproc 2 --tp 2 --sequence-parallel` writes tp and sequence parallel into the file's layout;
    `train` with that file refuses --tp 1 (each rank would hold whole blocks, twice what was planned) and a
    run without --sequence-parallel (each rank the whole sequence's norms and residuals), in one line before
    anything starts, as the Python entry does; with both given, the checks made before torchrun pass."""
    from pp_harness import fresh

    import tiertrain
    from tiertrain.cli.main import _check_layout
    from tiertrain.errors import ConfigError
    from tiertrain.plan import Plan
    from tiertrain.train.config import make_config

    out = tmp_path / "plan.json"
    assert _main("plan", "--model", "tiny", "--machine", "h100-sxm-80gb", "--batch", "4", "--seq", "64", "--solver",
                 "dp", "--nproc", "2", "--tp", "2", "--sequence-parallel", "--out", str(out)) == 0
    assert json.loads(out.read_text())["parallel"] == {"dp": 1, "tp": 2, "sequence_parallel": True}
    assert Plan.from_json(out.read_text()).parallel.sequence_parallel
    capsys.readouterr()
    run = ["train", "--model", "tiny", "--plan", str(out), "--out", str(tmp_path / "r"), "--steps", "1"]
    for extra, says in (([], r"was made for --tp 2 \(each rank 1/2 of a block\) but this run has --tp 1: give --tp 2"),
                        (["--nproc", "2", "--tp", "2"], "was made with --sequence-parallel .* add --sequence-parallel")):
        assert _main(*run, *extra) == 2
        err = capsys.readouterr().err
        assert re.search(says, " ".join(err.split())), err
    assert not (tmp_path / "r").exists()
    _check_layout(make_config({}, {"model": "tiny", "plan": str(out), "tp": 2, "sequence_parallel": True}), 2)
    model, opt = fresh()
    with pytest.raises(ConfigError, match="the plan was made with --sequence-parallel"):
        tiertrain.tensor_parallel(model, opt, 2, plan=str(out))
    from tiertrain.plan.pipeline import PipelineLayout

    model, opt = fresh()
    with pytest.raises(ConfigError, match=r"the plan was made for --tp 2 \(each rank 1/2 of a block\)"):
        tiertrain.pipeline(model, opt, PipelineLayout(pp=2, micro_batches=2), plan=str(out))
    with pytest.raises(ConfigError, match="sequence_parallel slices the sequence over a tensor-parallel group"):
        Plan.from_json(out.read_text().replace('"tp": 2', '"tp": 1'))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plan_tp_plans_a_transformers_models_share_by_its_parallelize_plan(tmp_path, capsys, family):
    """`plan --tp 2` of a transformers Llama (GQA) and GPT-2 (Conv1D): each rank holds half of a block's cut
    parameters and the whole of the rest, as the family's plan cuts it (of the block's chunk, its padding
    counted with the cut part); with --sequence-parallel too."""
    from pp_harness import config_of

    from tiertrain.models import build
    from tiertrain.runtime.blocks import block_numel, find_blocks

    model = tmp_path / "hf.json"
    model.write_text(json.dumps(config_of(family)))
    whole = {"llama": 2 * 32, "gpt2": 2 * 64 + 2 * 32}[family]  # two norms (GPT-2's with biases), c_proj's biases
    chunk = block_numel(find_blocks(build(config_of(family), device="meta"))[0])
    assert _main("plan", "--model", str(model), "--machine", "h100-sxm-80gb", "--seq", "16", "--solver", "dp",
                 "--nproc", "2", "--tp", "2", "--out", str(tmp_path / "p.json")) == 0
    said = " ".join(capsys.readouterr().out.split())
    mine = -(-(chunk - whole) // 2) + whole
    assert f"tensor parallel: --tp 2, each rank {mine:,} of a block's {chunk:,} parameters" in said, said
    assert _main("plan", "--model", str(model), "--machine", "h100-sxm-80gb", "--seq", "16", "--solver", "dp",
                 "--nproc", "2", "--tp", "2", "--sequence-parallel", "--out", str(tmp_path / "s.json")) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"--tp 2, each rank its slice of the sequence between them, each rank {mine:,} of a block's" in said, said
    assert json.loads((tmp_path / "s.json").read_text())["parallel"]["sequence_parallel"] is True


def test_plan_pp_tp_plans_a_stage_of_a_group_and_train_takes_the_plan_for_its_replicas(tmp_path, capsys):
    """`plan --nproc 8 --pp 2 --tp 2`: a rank's share of each block cut over its group, its stage of the
    pipeline (schedule, segments, micro-batches chosen), laid out for the 2 replicas; `train --nproc 8 --pp 2
    --tp 2` takes that plan, another --nproc is refused naming the layout's replicas. A pipeline's plan
    (`plan --nproc 4 --pp 2`) is taken by `train --nproc 4 --pp 2` likewise (its replicas, not its ranks)."""
    from tiertrain.cli.main import _check_layout
    from tiertrain.errors import ConfigError
    from tiertrain.train.config import make_config

    model = tmp_path / "untied.json"
    model.write_text(json.dumps({"n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256,
                                 "max_seq_len": 64, "tie_embeddings": False}))
    out = tmp_path / "plan.json"
    base = ["plan", "--model", str(model), "--machine", "h100-sxm-80gb", "--precision", "bf16", "--batch", "4",
            "--seq", "64", "--solver", "dp", "--out", str(out)]
    assert _main(*base, "--nproc", "8", "--pp", "2", "--tp", "2") == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "2 ranks, each with these budgets" in said and "tensor parallel: --tp 2, each rank" in said
    assert "pipeline: --pp 2 --schedule" in said and json.loads(out.read_text())["parallel"]["dp"] == 2
    cfg = {"model": str(model), "plan": str(out), "tp": 2, "pp": 2}
    _check_layout(make_config({}, cfg), 8)
    with pytest.raises(ConfigError, match="laid out for 2 ranks but --nproc 16 --pp 2 --tp 2 makes 4: use --nproc 8"):
        _check_layout(make_config({}, cfg), 16)
    assert _main(*base, "--nproc", "8", "--pp", "2", "--tp", "2", "--sequence-parallel") == 0  # the slices cross too
    said = " ".join(capsys.readouterr().out.split())
    assert "--tp 2, each rank its slice of the sequence between them" in said and "pipeline: --pp 2" in said, said
    assert json.loads(out.read_text())["parallel"] == {"dp": 2, "tp": 2, "sequence_parallel": True}
    _check_layout(make_config({}, {**cfg, "sequence_parallel": True}), 8)
    assert _main(*base, "--nproc", "4", "--pp", "2") == 0
    _check_layout(make_config({}, {"model": str(model), "plan": str(out), "pp": 2}), 4)
    capsys.readouterr()
    assert _main(*base, "--nproc", "4", "--pp", "4", "--tp", "2") == 2
    assert "--pp 4 does not divide --nproc 4 / --tp 2" in capsys.readouterr().err


def test_plan_layouts_plans_every_layout_of_the_ranks_and_writes_the_fastests(tmp_path, capsys):
    """`plan --nproc 4 --layouts`: every tp dividing the node (whose cut the model allows) x every pp
    dividing the rest is planned and printed with its replicas, predicted step and tokens a second (its
    replicas' sequences over its step); the fastest is named and its plan written, laid out for its
    replicas; a layout given as well is refused."""
    import re

    model = tmp_path / "untied.json"
    model.write_text(json.dumps({"n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256,
                                 "max_seq_len": 64, "tie_embeddings": False}))
    out = tmp_path / "plan.json"
    base = ["plan", "--model", str(model), "--machine", "h100-sxm-80gb", "--batch", "4", "--seq", "64", "--solver",
            "dp", "--nproc", "4", "--out", str(out)]
    assert _main(*base, "--layouts") == 0
    said = capsys.readouterr().out
    rows = {(int(tp), int(pp)): (int(dp), float(ms), int(tps.replace(",", ""))) for tp, pp, dp, ms, tps in
            re.findall(r"--tp (\d) --pp (\d) │ (\d+) +│ ([\d.e+-]+) ms +│ ([\d,]+)", said)}
    assert set(rows) == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)}, said  # tp 4 does not divide the 2 heads
    for (tp, pp), (dp, ms, tps) in rows.items():
        assert dp == 4 // (tp * pp) and tps == pytest.approx(dp * 4 * 64 / (ms / 1e3), rel=1e-3), (tp, pp)
    (tp, pp), (dp, _, tps) = max(rows.items(), key=lambda r: r[1][2])
    assert f"fastest layout: --nproc 4 --tp {tp} --pp {pp} ({dp} replicas), {tps:,} tokens/s" in said, said
    assert json.loads(out.read_text())["parallel"]["dp"] in (dp, 1)
    assert _main(*base, "--layouts", "--tp", "2") == 2
    assert "leave out --tp, --pp" in capsys.readouterr().err
    assert _main(*base, "--layouts", "--model", "tiny") == 0  # tied: train refuses pp x tp of it, so plan does
    said = capsys.readouterr().out
    assert re.search(r"--tp 2 --pp 2 │ 1 +│ - +│ - +│ a tied embedding in", said), said


@pytest.mark.parametrize("extra,says", [
    (["--nproc", "2", "--tp", "3"], "--tp 3 must divide --nproc 2"),
    (["--nproc", "8", "--nproc-per-node", "2", "--tp", "4"], "must divide --nproc 8 and --nproc-per-node 2"),
    (["--nproc", "4", "--tp", "2", "--pp", "2"], "a tied embedding in a pipeline cut over tensor-parallel ranks"),
    (["--nproc", "4", "--tp", "2", "--ep", "4", "--model", "tiny-moe"], "ep=4 does not divide the 2 data-parallel"),
    (["--nproc", "2", "--sequence-parallel"], "--sequence-parallel plans a tensor-parallel group's sequence slices"),
    (["--nproc", "8", "--tp", "8"], "--tp 8 must divide the model's attention heads (n_head), 2"),
    (["--nproc", "2", "--tp", "2", "--update", "lockfree", "--max-staleness", "2", "--grad-clip", "0"],
     ("max staleness 2 lets each rank read params of another age, and a tensor-parallel group's ranks must read the "
      "same: give --max-staleness 1 (a fixed lag of one step) or 0")),
])
def test_a_tensor_parallel_plan_it_cannot_make_is_refused_in_one_line(tmp_path, capsys, extra, says):
    assert _main("plan", "--model", "tiny", "--machine", "h100-sxm-80gb", *extra, "--out", str(tmp_path / "p")) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("error:") == 1, err


def test_max_model_over_a_cluster_answers_with_the_layout_that_reaches_it(tmp_path, capsys):
    """Two ranks of a small machine: each tensor-parallel size they allow is searched and printed (tp 1: the
    states split over two replicas; tp 2: each block cut over both); the answer is the one with the most
    parameters, with its layout, beside the capacity bound of both ranks, and above what one rank alone
    trains."""
    from tiertrain.autoplan.largest_model import RunShape, largest_model
    from tiertrain.plan import Budgets
    from tiertrain.plan.fit import capacity_params

    machine = tmp_path / "small.json"
    machine.write_text(small_machine().to_json())
    sizes = Budgets(GiB, GiB, small_machine().disk_bytes)
    assert _main("plan", "--max-model", "--machine", str(machine), "--batch", "1", "--seq", "64", "--page-size",
                 "64KiB", "--device-memory", "1GiB", "--host-memory", "1GiB", "--nproc", "2",
                 "--out", str(tmp_path / "p.json")) == 0
    said = " ".join(capsys.readouterr().out.split())
    layouts = {tp: int(said.split(f"--tp {tp} dp {2 // tp} ")[1].split(" x ")[0]) for tp in (1, 2)}
    best = max(layouts, key=layouts.get)
    assert f"layout: --nproc 2 --tp {best}:" in said, said
    assert f"model that fits: {layouts[best]} blocks" in said or layouts[1] == layouts[2]
    assert f"x ranks / 16 B per param: {_count(2 * capacity_params(sizes))} params" in said, said
    one = largest_model(small_machine(), sizes, RunShape(1, 64, "fp32", "sync", True, 1, 64 << 10))
    assert one.params < int(float(said.split("fits: ")[1].split("(")[1].split("M params")[0]) * 1e6)


def _count(n: int) -> str:
    from tiertrain.units import format_count

    return format_count(n)


def test_max_model_over_a_group_takes_a_lag_of_one_step_at_most(tmp_path, capsys):
    """`plan --max-model --tp 2` refuses a free loop lagging two steps, as `plan --tp` and train do."""
    assert _main("plan", "--max-model", "--machine", "h100-sxm-80gb", "--nproc", "2", "--tp", "2", "--update",
                 "lockfree", "--max-staleness", "2", "--grad-clip", "0", "--out", str(tmp_path / "p.json")) == 2
    err = capsys.readouterr().err
    assert "max staleness 2 lets each rank read params of another age" in err and err.count("error:") == 1, err


@pytest.mark.parametrize("family,ends", [("llama", (True, False)), ("gpt2", (True, True)), ("gpt", (False, False))])
def test_plan_pp_tp_counts_the_whole_sequence_a_stages_ends_gather_under_sequence_parallel(tmp_path, monkeypatch,
                                                                                           family, ends):
    """Under sequence parallel a stage after the first of a Llama or GPT-2 gathers its input whole (its mask
    and rotary tables built for the whole sequence), and GPT-2's stages before the last their output: an
    all-gather each way per end; our GPT's stages gather nothing. The pipeline's planner charges each virtual
    stage its own ends (the busiest rank's over its segments), and a stage's tier plan its worst stage's."""
    from pp_harness import config_of

    from tiertrain.plan.pipeline import PipelineLayout
    from tiertrain.planner import tensor
    from tiertrain.planner.network import Network
    from tiertrain.planner.pipeline import for_stage, stage_times
    from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile

    seen = []
    mark = tensor.with_stage_ends
    monkeypatch.setattr(tensor, "with_stage_ends", lambda p, *a: seen.append(a[:2]) or mark(p, *a))
    model = tmp_path / "m.json"
    model.write_text(json.dumps(config_of(family, tied=False)))
    assert _main("plan", "--model", str(model), "--machine", "h100-sxm-80gb", "--seq", "16", "--solver", "dp",
                 "--nproc", "4", "--pp", "2", "--tp", "2", "--sequence-parallel", "--grad-clip", "0",
                 "--out", str(tmp_path / "p.json")) == 0
    assert seen == [ends]
    machine = MachineProfile(h2d_bps=1e10, d2h_bps=1e10, disk_read_bps=1e9, disk_write_bps=1e9, adam_params_per_s=1e9)
    block = BlockProfile("blocks.0", 1.0, 2.0, 1000, 1 << 12, 1 << 10)
    bare = Profile((block,) * 4, BlockProfile("rest", 0.0, 0.0, 0, 0, 0), machine)
    g_in, g_out = 0.25 * ends[0], 0.125 * ends[1]
    p = dataclasses.replace(bare, gather_in_s=g_in, gather_out_s=g_out)
    # rank r runs virtual stages r, r + pp, ...: at pp 2 x 2 segments rank 0 has stages 0 (out) and 2 (in, out),
    # rank 1 stages 1 (in, out) and 3 (in); at pp 2, stage 0 its output's gather, stage 1 its input's
    for layout, worst_rank, worst_stage in ((PipelineLayout(2, "1f1b", 2), max(g_in, g_out), max(g_in, g_out)),
                                            (PipelineLayout(2, "aiao", 4, 2), max(g_in + 2 * g_out, 2 * g_in + g_out),
                                             g_in + g_out)):
        more, _ = stage_times(p, layout, Network(), 1e9)
        base, _ = stage_times(bare, layout, Network(), 1e9)
        assert (more.compute_s - base.compute_s, more.backward_s - base.backward_s) == pytest.approx(
            (2 * worst_rank, worst_rank)), layout
        staged, plain = for_stage(p, layout, 2), for_stage(bare, layout, 2)
        assert staged.blocks[0].forward_s - plain.blocks[0].forward_s == pytest.approx(worst_stage), layout
        assert staged.blocks[1] == plain.blocks[1] and (staged.gather_in_s, staged.gather_out_s) == (0.0, 0.0)
