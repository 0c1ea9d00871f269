"""The planner over several ranks (issue 19 item 5): per-rank budgets, the collectives' rates in the
profile, a network resource in the simulator, and the choice between every block sharded (ZeRO-2/3)
and replicated (DDP); ``tiertrain plan --nproc N`` writes a plan that ``train --nproc N`` runs."""

import dataclasses
import json
import re
import os
import subprocess
import sys

import pytest

from tiertrain.plan import Budgets, builtin_plan, data_parallel
from tiertrain.plan.fit import tier_bytes
from tiertrain.plan.tiers import Tier
from tiertrain.planner.auto import NoPlanFits, choose_layout, run_profile
from tiertrain.planner.network import Network
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.planner.simulator import simulate
from tiertrain.planner.solvers import Problem

MiB = 1 << 20
N_BLOCKS, PARAMS, REST = 4, 2_000_000, 1_000_000
# the device holds every block resident and, with data parallel, two blocks' gradients being reduced
# (``plan.bytes.reduce_staging``): 72 MiB holds both layouts resident
RATE = 1e9


def _profile(dp: int, rate: float = RATE, network: Network | None = None, adam: float = 1e9) -> Profile:
    block = BlockProfile("b", 4e-3, 8e-3, PARAMS, 4 * MiB, 1 * MiB)
    m = MachineProfile(h2d_bps=10e9, d2h_bps=10e9, disk_read_bps=1e9, disk_write_bps=1e9, adam_params_per_s=adam)
    p = Profile(tuple(dataclasses.replace(block, name=f"blocks.{i}") for i in range(N_BLOCKS)),
                BlockProfile("rest", 1e-3, 2e-3, REST, 0, 0), m, page=64 << 10,
                network=network or Network.from_link(dp, rate, "test"))
    return run_profile(p, "sync", 1, needs_all_grads=True)


def _states_bytes() -> int:
    return (N_BLOCKS * PARAMS + REST) * 16  # master, two moments, one gradient chunk: fp32


def test_where_the_cpu_updates_dominate_sharding_is_chosen_each_rank_updates_half():
    """With states in host, each rank of a sharded plan updates half of them: where the CPU updates
    take longer than what the extra all-gathers cost, sharding wins."""
    pb = Problem.sized(_profile(2, adam=1e8), Budgets(device=72 * MiB, host=4 * _states_bytes()))
    chosen, cands = choose_layout(pb, ("dp",), "sync", True, 1)
    plan = chosen.plan
    assert plan.parallel.dp == 2 and all(b.shard for b in (*plan.blocks, plan.rest))
    assert {c.plan.name for c in cands} == {"auto/dp/sharded x2", "auto/dp/replicated x2"}
    ddp = next(c for c in cands if "replicated" in c.plan.name)
    assert ddp.sim.timeline.busy("cpu") == pytest.approx(2 * chosen.sim.timeline.busy("cpu"), rel=0.01)


def test_a_device_that_holds_sharded_states_keeps_the_sharded_layout_among_the_candidates():
    """A resident sharded block's slot holds the whole block beside its master's shard (no
    ``master_in_slot``): the solver counted no slot for it, homed the states on the device where they
    did not fit, and the sharded layout vanished from plan auto's candidates at 72 MiB and above."""
    for device in (72, 128):
        pb = Problem.sized(_profile(2, adam=1e8), Budgets(device=device * MiB, host=4 * _states_bytes()))
        chosen, cands = choose_layout(pb, ("dp",), "sync", True, 1)
        assert "auto/dp/sharded x2" in {c.plan.name for c in cands if c.plan is not None}, device
        assert chosen.plan.name == "auto/dp/sharded x2"


def test_where_updates_are_quick_and_reduce_scatter_is_an_all_reduce_as_over_gloo_ddp_is_chosen():
    """DDP's all-reduce runs under the next block's backward; ZeRO-2's all-gather of the new params
    follows the update: where updates are quick, replicating is faster."""
    gloo = Network(2, True, all_gather_bps=RATE, reduce_scatter_bps=RATE / 2, all_reduce_bps=RATE,
                   all_to_all_bps=RATE, source="as gloo measures")
    pb = Problem.sized(_profile(2, network=gloo), Budgets(device=72 * MiB, host=4 * _states_bytes()))
    chosen, cands = choose_layout(pb, ("dp",), "sync", True, 1)
    assert chosen.plan.name.startswith("auto/dp/replicated x2")  # then some blocks switched (test below)
    ddp = next(c for c in cands if c.plan.name == "auto/dp/replicated x2")
    zero = next(c for c in cands if c.plan.name == "auto/dp/sharded x2")
    assert ddp.sim.step_s < zero.sim.step_s and not any(b.shard for b in (*ddp.plan.blocks, ddp.plan.rest))


def test_when_whole_states_do_not_fit_a_rank_sharding_is_chosen_and_each_rank_holds_its_share():
    host = int(0.85 * _states_bytes())  # whole states and gradients do not fit a rank; half of them do
    pb = Problem.sized(_profile(2), Budgets(device=64 * MiB, host=host))
    chosen, _ = choose_layout(pb, ("dp",), "sync", True, 1)
    plan = chosen.plan
    assert plan.parallel.dp == 2 and all(b.shard for b in (*plan.blocks, plan.rest))
    numels = [PARAMS] * N_BLOCKS + [REST]
    assert tier_bytes(numels, plan, 64 << 10)[Tier.HOST] <= host  # what the runtime's budget check counts
    with pytest.raises(NoPlanFits):  # and no plan fits one process with these budgets
        choose_layout(Problem.sized(_profile(1), Budgets(device=64 * MiB, host=host)), ("dp",), "sync", True, 1)


@pytest.mark.parametrize("dp", [2, 4])
def test_the_simulated_network_carries_the_layouts_bytes(dp):
    """Seconds on the net at the rate are the bytes each rank sends: DDP 2 (N-1)/N x every gradient;
    ZeRO-3 (every block streamed, one slot) (N-1)/N x each block's params gathered for forward and
    again for backward (but the last, still in its slot) and its gradients reduce-scattered; the rest
    (resident, ZeRO-2) its gradients reduce-scattered and its new params gathered."""
    p = _profile(dp)
    share = (dp - 1) / dp
    ddp = data_parallel(builtin_plan("resident", N_BLOCKS), dp, shard=False)
    sent = simulate(ddp, p, True).timeline.busy("net") * RATE
    assert sent == pytest.approx(2 * share * 4 * (N_BLOCKS * PARAMS + REST), rel=1e-9)
    zero3 = data_parallel(dataclasses.replace(builtin_plan("stream", N_BLOCKS), window=1, prefetch=0), dp)
    sent = simulate(zero3, p, True).timeline.busy("net") * RATE
    blocks = (2 * N_BLOCKS - 1) * PARAMS * share * 4 + N_BLOCKS * PARAMS * share * 4  # gathers, reductions
    assert sent == pytest.approx(blocks + share * 2 * 4 * REST, rel=1e-9)


def test_a_slower_network_predicts_a_slower_step_and_one_rank_sends_nothing():
    plan = data_parallel(builtin_plan("stream", N_BLOCKS), 2)
    fast, slow = simulate(plan, _profile(2), True), simulate(plan, _profile(2, RATE / 100), True)
    assert slow.step_s > fast.step_s and slow.bottleneck == "net"
    assert simulate(builtin_plan("stream", N_BLOCKS), _profile(1), True).timeline.busy("net") == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiertrain", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_plan_nproc_for_a_described_machine_takes_its_link_and_refuses_one_without(tmp_path, capsys):
    from tiertrain.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-small", "--batch", "2", "--seq", "64", "--machine", "h100-sxm-80gb",
                 "--nproc", "8", "--solver", "dp", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "8 ranks, each with these budgets; network: h100-sxm-80gb's link nvlink4" in " ".join(said.split())
    assert json.loads(out.read_text())["parallel"] == {"dp": 8}
    from tiertrain.planner.datasheets import find_machine

    lonely = dataclasses.replace(find_machine("h100-sxm-80gb"), network=(), name="lonely")
    (tmp_path / "lonely.json").write_text(lonely.to_json())
    assert main(["plan", "--model", "gpt-small", "--machine", str(tmp_path / "lonely.json"), "--nproc", "2",
                 "--out", str(out)]) == 2
    assert "describes no network link" in capsys.readouterr().err
    assert main(["plan", "--max-model", "--machine", "h100-sxm-80gb", "--nproc", "2", "--pp", "2", "--out",
                 str(out)]) == 2
    assert "leave out --pp and --ep" in capsys.readouterr().err


def test_plan_nproc_measures_this_machines_collectives_and_train_nproc_runs_the_plan(tmp_path):
    plan, out = tmp_path / "plan.json", tmp_path / "run"
    r = _cli("plan", "--model", "tiny", "--batch", "4", "--seq", "32", "--device-memory", "4MiB", "--host-memory",
             "64MiB", "--nproc", "2", "--grad-clip", "0", "--page-size", "64KiB", "--solver", "dp", "--out", str(plan))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "measured here over 2 local gloo ranks" in " ".join(r.stdout.split())
    assert json.loads(plan.read_text())["parallel"] == {"dp": 2}
    r = _cli("train", "--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--grad-clip", "0", "--steps", "2",
             "--plan", str(plan), "--page-size", "64KiB", "--device-memory", "4MiB", "--host-memory", "64MiB",
             "--out", str(out), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 2 steps" in r.stdout


# ---------------------------------------------------------------- over several nodes: hybrid sharding

def _nodes(dp: int = 4, per_node: int = 2, across: float = RATE / 10) -> Network:
    return dataclasses.replace(Network.from_link(dp, RATE, "test"), node_ranks=per_node, across_bps=across)


def test_the_simulated_network_carries_hybrid_bytes_inside_a_node_and_across_at_each_links_rate():
    """2 nodes x 2 ranks, the link between nodes 10x slower: a hybrid ZeRO-2 plan reduce-scatters each
    block inside the node ((S-1)/S of its gradients) and gathers its new params there, at the node's rate,
    and all-reduces the shard across (2 (R-1)/R x 1/S of them) at the slow one; flat sharding sends every
    collective over the ring that crosses the slow link."""
    p = _profile(4, network=_nodes())
    grads = 4 * (N_BLOCKS * PARAMS + REST)
    hybrid = data_parallel(builtin_plan("resident", N_BLOCKS), 4, shard_group=2)
    inside, across = 0.5 * grads + 0.5 * grads, 2 * 0.5 * grads / 2  # RS + gather inside; AR of a half across
    assert simulate(hybrid, p, True).timeline.busy("net") == pytest.approx(inside / RATE + across / (RATE / 10))
    flat = data_parallel(builtin_plan("resident", N_BLOCKS), 4)
    assert simulate(flat, p, True).timeline.busy("net") == pytest.approx(2 * 0.75 * grads / (RATE / 10))


def test_over_nodes_with_a_slow_link_between_them_the_planner_chooses_hybrid_where_half_the_states_fit():
    """Hybrid holds 1/S of the states per rank (S a node's ranks), flat sharding 1/N: with a slow link
    between nodes hybrid is chosen where a node's share fits a rank; where only 1/N fits, flat sharding
    is the one layout that fits, and is chosen."""
    budgets = Budgets(device=72 * MiB, host=int(0.75 * _states_bytes()))  # half of the states and what reduces fit
    pb = Problem.sized(_profile(4, network=_nodes(), adam=1e8), budgets)
    chosen, cands = choose_layout(pb, ("dp",), "sync", True, 1)
    assert "auto/dp/hybrid 2x2 x4" in {c.plan.name for c in cands if c.plan is not None}
    assert chosen.plan.name == "auto/dp/hybrid 2x2 x4" and chosen.plan.parallel.shard_group == 2
    numels = [PARAMS] * N_BLOCKS + [REST]
    assert tier_bytes(numels, chosen.plan, 64 << 10)[Tier.HOST] <= budgets.host
    tight = Budgets(device=72 * MiB, host=int(0.35 * _states_bytes()))  # a quarter fits, half does not
    chosen, _ = choose_layout(Problem.sized(_profile(4, network=_nodes(), adam=1e8), tight), ("dp",), "sync", True, 1)
    assert chosen.plan.name == "auto/dp/sharded x4" and not chosen.plan.parallel.hybrid


def test_plan_over_nodes_takes_the_machines_second_link_between_them_and_refuses_what_cannot_be_planned(
        tmp_path, capsys):
    from tiertrain.cli.main import main
    from tiertrain.planner.datasheets import find_machine

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-small", "--batch", "2", "--seq", "64", "--machine", "h100-sxm-80gb",
                 "--nproc", "16", "--nproc-per-node", "8", "--solver", "dp", "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "between the 2 nodes" in said and "connectx7-400g 50.0 GB/s" in said
    assert json.loads(out.read_text())["parallel"] == {"dp": 16, "shard_group": 8}
    assert "replicated across the 2 nodes (hybrid)" in said
    one_link = dataclasses.replace(find_machine("h100-sxm-80gb"), network=find_machine("h100-sxm-80gb").network[:1],
                                   name="one-link")
    (tmp_path / "one.json").write_text(one_link.to_json())
    for args, want in ((["--machine", str(tmp_path / "one.json")], "add the link between nodes"),
                       (["--machine", "h100-sxm-80gb", "--nproc-per-node", "6"], "does not divide --nproc 16"),
                       ([], "give --machine")):
        flags = ["--nproc-per-node", "8", *args] if "--nproc-per-node" not in args else args
        assert main(["plan", "--model", "gpt-small", "--nproc", "16", *flags, "--out", str(out)]) == 2, args
        assert want in capsys.readouterr().err, args


def test_a_hybrid_layout_is_refused_with_expert_parallel_and_where_its_groups_do_not_divide_the_ranks():
    from tiertrain.errors import ConfigError
    from tiertrain.plan import ParallelLayout

    assert ParallelLayout(4, shard_group=2).hybrid and ParallelLayout(4, shard_group=2).shard_ranks == 2
    assert ParallelLayout(4, shard_group=4) == ParallelLayout(4)  # one group of every rank is flat sharding
    for kwargs, says in (({"shard_group": 3}, "choose --shard-group among 2 (the GPUs of one node)"),
                         ({"shard_group": 1}, "groups of two or more"),
                         ({"shard_group": 2, "ep": 2}, "with expert parallel (ep=2) is not supported yet")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            ParallelLayout(4, **kwargs)


def test_each_blocks_layout_is_chosen_for_it_where_a_mixed_plan_is_predicted_faster():
    """With quick CPU updates, replicating a block spares its post-update gather while sharding another
    halves its update: one pass over the blocks switches each where the simulator predicts a faster step
    and the plan still fits; the mixed plan is among the candidates, faster than either uniform one."""
    budgets = Budgets(device=72 * MiB, host=4 * _states_bytes())
    chosen, cands = choose_layout(Problem.sized(_profile(2, adam=1e9), budgets), ("dp",), "sync", True, 1)
    flags = [b.shard for b in (*chosen.plan.blocks, chosen.plan.rest)]
    assert True in flags and False in flags and chosen.plan.name.endswith("switched"), chosen.plan.name
    uniform = [c for c in cands if c.plan is not None and c is not chosen]
    assert uniform and all(chosen.sim.step_s < c.sim.step_s for c in uniform)
    numels = [PARAMS] * N_BLOCKS + [REST]
    assert tier_bytes(numels, chosen.plan, 64 << 10)[Tier.HOST] <= budgets.host


# ---------------------------------------------------------------- expert parallel in the planner

EXPERTS = 1_500_000  # of each block's PARAMS, its experts: one rank holds half of them at ep = 2


def test_a_ranks_held_experts_are_counted_whole_and_reduced_over_their_replicas_only():
    """At dp 4, ep 2 a rank holds its experts whole (a quarter of them is not its share: they are not
    sharded) and the rest of the block sharded; the simulated network carries the rest's reduce-scatter
    and gather over all 4 ranks and the experts' all-reduce over their 2 replicas."""
    from tiertrain.plan.fit import Sizes
    from tiertrain.planner.costs import own_numel
    from tiertrain.planner.profile import with_experts

    sizes = Sizes((PARAMS - EXPERTS,) * N_BLOCKS + (REST,), (EXPERTS // 2,) * N_BLOCKS + (0,))
    p = with_experts(_profile(4, network=dataclasses.replace(Network.from_link(4, RATE, "test"), ep=2)), sizes)
    b = p.blocks[0]
    assert b.experts == EXPERTS // 2 and b.shared == PARAMS - EXPERTS
    assert own_numel(p.network, b) == -(-b.shared // 4) + b.experts and p.sizes() == sizes
    plan = data_parallel(builtin_plan("resident", N_BLOCKS), 4, ep=2)
    shared, held = 4 * (N_BLOCKS * b.shared + REST), 4 * N_BLOCKS * b.experts
    want = 0.75 * shared + 0.75 * shared + 2 * 0.5 * held  # RS + gather of the rest over 4; AR of experts over 2
    assert simulate(plan, p, True).timeline.busy("net") * RATE == pytest.approx(want, rel=1e-9)


def test_plan_with_ep_plans_each_rank_with_the_experts_it_holds_and_refuses_what_cannot_run(tmp_path, capsys):
    from tiertrain.cli.main import main
    from tiertrain.models import build, resolve_config

    out = tmp_path / "plan.json"
    base = ["plan", "--model", "tiny-moe", "--batch", "2", "--seq", "32", "--machine", "h100-sxm-80gb", "--solver", "dp"]
    assert main([*base, "--nproc", "4", "--ep", "2", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["parallel"] == {"dp": 4, "ep": 2}
    capsys.readouterr()
    for args, says in ((["--nproc", "4", "--ep", "3"], "ep=3 does not divide the 4 data-parallel ranks"),
                       (["--ep", "2"], "plan a --model over --nproc N ranks"),
                       (["--nproc", "8", "--ep", "8"], "--ep 8 does not divide the model's 4 experts")):
        assert main([*base, *args, "--out", str(out)]) == 2, args
        assert says in capsys.readouterr().err, args
    dense = ["plan", "--model", "gpt-small", "--batch", "2", "--seq", "32", "--machine", "h100-sxm-80gb"]
    assert main([*dense, "--nproc", "2", "--ep", "2", "--out", str(out)]) == 2
    assert "no mixture-of-experts layer" in capsys.readouterr().err
    # a pipeline's stages over 4 replicas, each stage's experts over pairs of them: a rank holds half its experts
    held = {}
    for ep in (1, 2):
        assert main([*base, "--nproc", "8", "--pp", "2", "--ep", str(ep), "--out", str(out)]) == 0
        said = " ".join(capsys.readouterr().out.split())
        held[ep] = int(re.search(r"per rank: ([\d,]+) parameters", said).group(1).replace(",", ""))
        assert json.loads(out.read_text())["parallel"] == ({"dp": 4, "ep": 2} if ep > 1 else {"dp": 4})
    model = build(resolve_config("tiny-moe"), device="meta")
    experts = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.0.ffn.experts."))
    assert held[1] - held[2] == experts // 2, held  # (a stage holds one of the 2 blocks)
    assert main([*base, "--nproc", "4", "--pp", "2", "--ep", "4", "--out", str(out)]) == 2
    assert "ep=4 does not divide the 2 data-parallel ranks" in capsys.readouterr().err


def test_gradients_reduced_once_a_step_are_counted_as_every_blocks_stage_held_at_once():
    """``reduce_every="step"`` holds each block's stage (its whole gradients in the reduce dtype) from its
    first micro-batch to its reduction, and lets every block's reduction be in flight at once (they land as
    the step begins): the budget counts every block's stage and part where they live, not the two of a
    reduction every micro-batch; each lands in the block's first grad chunk of the step."""
    from tiertrain.plan.bytes import pages

    page, dp = 64 << 10, 2
    numels = [PARAMS] * N_BLOCKS + [REST]
    every = data_parallel(builtin_plan("stream", N_BLOCKS), dp)
    once = dataclasses.replace(every, reduce_every="step")
    stages = [pages(n * 4, page) for n in numels]  # whole blocks in fp32, padded to pages
    added = tier_bytes(numels, once, page)[Tier.DEVICE] - tier_bytes(numels, every, page)[Tier.DEVICE]
    parts = [pages(n * 4 // dp, page) for n in numels]
    assert added == sum(stages) + sum(parts) - 2 * (max(stages) + max(parts))
    # a reduction lands in the block's first grad chunk of the step: where every block's gradients are
    # counted, nothing more; where they are updated away, every block's landing chunk (host, with the states)
    assert tier_bytes(numels, once, page)[Tier.HOST] == tier_bytes(numels, every, page)[Tier.HOST] - 2 * max(parts)
    away = [tier_bytes(numels, p, page, grads="transient")[Tier.HOST] for p in (once, every)]
    assert away[0] - away[1] == sum(parts) - 2 * max(parts)
    from tiertrain.plan.fit import over_budgets  # what `plan --pp` says of a stage's plan reduced once a step

    fits_every = Budgets(device=tier_bytes(numels, every, page)[Tier.DEVICE], host=1 << 40)
    assert over_budgets(numels, every, page, fits_every) == {}
    assert over_budgets(numels, once, page, fits_every) == {Tier.DEVICE: tier_bytes(numels, once, page)[Tier.DEVICE]}


def test_plan_pp_plans_each_ranks_stage_and_chooses_the_schedule_by_fold3ds_model(tmp_path, capsys):
    """16 H100s over 2 nodes as 8 replicas of a 2-stage pipeline: each rank's tier plan is for its stage's
    half of the blocks, its data-parallel replicas span the nodes, and FOLD3D's model names the schedule,
    segments and micro-batches with the step it predicts and why; what cannot be is refused first."""
    from tiertrain.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-small", "--batch", "8", "--seq", "64", "--machine", "h100-sxm-80gb",
                 "--nproc", "16", "--nproc-per-node", "8", "--pp", "2", "--solver", "dp", "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    plan = json.loads(out.read_text())
    from tiertrain.models import resolve_config
    from tiertrain.plan.pipeline import fold

    chosen = re.search(r"pipeline: --pp 2 --schedule (\w+) --segments (\d+) --micro-batches (\d+) --batch-size "
                       r"(\d+): predicted step ([\d.]+) ms", said)
    assert chosen and int(chosen[3]) in (1, 2, 4, 8) and "why: DP.sync" in said, said
    assert int(chosen[3]) * int(chosen[4]) == 8  # train --pp's --batch-size is a micro-batch's
    largest = max(map(len, fold(resolve_config("gpt-small").n_layer, 2, int(chosen[2]))))
    assert len(plan["blocks"]) == largest and plan["parallel"] == {"dp": 8}  # no hybrid sharding inside a stage
    assert "activation checkpoints" in said and "between the 2 nodes" in said
    # a given layout is planned, not chosen (train --pp --plan auto plans so)
    assert main(["plan", "--model", "gpt-small", "--batch", "8", "--seq", "64", "--machine", "h100-sxm-80gb",
                 "--nproc", "4", "--pp", "2", "--schedule", "1f1b", "--grad-accum", "4", "--solver", "dp",
                 "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "pipeline: --pp 2 --schedule 1f1b --segments 1 --micro-batches 4 --batch-size 2" in said, said
    for args, want in ((["--nproc", "6", "--pp", "4"], "--pp 4 does not divide --nproc 6"),
                       (["--pp", "2"], "--pp 2 does not divide --nproc 1"),
                       (["--schedule", "aiao"], "--schedule plans a pipeline's stages: add --pp"),
                       (["--nproc", "2", "--pp", "2", "--schedule", "1f1b"], "give --micro-batches 2 or more")):
        assert main(["plan", "--model", "gpt-small", "--machine", "h100-sxm-80gb", *args, "--out", str(out)]) == 2
        assert want in capsys.readouterr().err, args


@pytest.mark.parametrize("schedule, micro, segments, in_flight", [
    ("gpipe", 8, 1, 8), ("1f1b", 8, 1, 2), ("aiao", 4, 2, 4), ("interleaved", 4, 2, 3)])
def test_a_pipeline_stage_is_planned_with_its_schedules_micro_batches_in_flight(schedule, micro, segments,
                                                                                in_flight):
    """A stage's activations are a micro-batch's (the profile's batch over M), held for as many micro-batches
    at once as its schedule keeps in flight (FOLD3D's eqs. 6-7 over the segments; 1F1B's first stage: pp),
    and the offloaded ones of the micro-batch prefetched ahead of its backward are on the device too: in the
    budget's activations, the solvers' per-block device bytes, the simulated peaks and the host's stash."""
    from tiertrain.plan import builtin_plan
    from tiertrain.plan.pipeline import PipelineLayout
    from tiertrain.planner import costs
    from tiertrain.planner.costs import CHOICES, activation_bytes, device_bytes, stash_bytes
    from tiertrain.planner.pipeline import for_stage
    from tiertrain.planner.simulator import simulate

    whole = _profile(1)
    whole = dataclasses.replace(whole, rest=dataclasses.replace(whole.rest, act_bytes=8 * MiB))  # the logits
    stage = for_stage(whole, PipelineLayout(2, schedule, micro, segments), 4)
    assert len(stage.blocks) == 4 and stage.micro_in_flight == in_flight and stage.stash_ahead
    assert stage.blocks[0].act_bytes * micro == whole.blocks[0].act_bytes  # 4 MiB over 4 or 8 rows' share
    act, hidden, logits = stage.blocks[0].act_bytes, stage.blocks[0].hidden_bytes, stage.rest.act_bytes
    plain = builtin_plan("stream", 4, update="sync")
    half = dataclasses.replace(plain, blocks=plain.blocks[:2] + tuple(
        dataclasses.replace(b, recompute=True, offload_hidden=True) for b in plain.blocks[2:]))
    one = dataclasses.replace(stage, micro_in_flight=1, stash_ahead=False, micro_batches=1)
    # two blocks and the logits kept for every micro-batch in flight, two stashed: one micro-batch of those back
    more = (in_flight - 1) * (2 * act + logits) + 2 * hidden
    assert activation_bytes(half, stage) - activation_bytes(half, one) == more
    assert stash_bytes(half, stage) == in_flight * stash_bytes(half, one)
    kept, stashed = (next(c for c in CHOICES if c.stream and c.offload_hidden == off and c.recompute == off)
                     for off in (False, True))
    assert device_bytes(stage, stage.blocks[0], kept) - device_bytes(one, one.blocks[0], kept) == (in_flight - 1) * act
    assert device_bytes(stage, stage.blocks[0], stashed) - device_bytes(one, one.blocks[0], stashed) == hidden
    sims = [simulate(half, p) for p in (stage, one)]
    assert sims[0].peaks["device"] - sims[1].peaks["device"] == more
    assert sims[0].peaks["host"] - sims[1].peaks["host"] == (in_flight - 1) * 2 * hidden
    # each micro-batch's stash moves: the copies take M micro-batches' time, in the solvers' costs and the simulator
    copies = [sum(e - s for _, s, e, label in sim.timeline.tasks if "stash" in label) for sim in sims]
    assert copies[0] == pytest.approx(micro * copies[1])
    m = stage.machine
    seconds = [costs.block_seconds(stage.blocks[0], stashed, m, 4, 1, micro_batches=k) for k in (micro, 1)]
    assert seconds[0] - seconds[1] == pytest.approx((micro - 1) * hidden * (1 / m.d2h_bps + 1 / m.h2d_bps))
