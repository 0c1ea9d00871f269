import random

import pytest

from tiertrain.planner.machine import Load
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.plan import Budgets
from tiertrain.planner.solvers import Problem, dynamic_programming, exhaustive, greedy, random_search, stronghold

MiB = 1 << 20


def synthetic(n: int, rng: random.Random | None = None, compute_scale: float = 1.0, link_scale: float = 1.0,
              params: int = 2_000_000) -> Profile:
    """Blocks like a small Transformer's, sizes and times jittered per block when ``rng`` is given."""
    jitter = (lambda: rng.uniform(0.7, 1.3)) if rng else (lambda: 1.0)
    blocks = tuple(BlockProfile(f"b{i}", forward_s=0.010 * compute_scale * jitter(), backward_s=0.020 * compute_scale * jitter(),
                                params=int(params * jitter()), act_bytes=int(24 * MiB * jitter()),
                                hidden_bytes=int(2 * MiB * jitter())) for i in range(n))
    machine = MachineProfile(h2d_bps=5e8 / link_scale, d2h_bps=5e8 / link_scale, disk_read_bps=1e9,
                             disk_write_bps=1e9, adam_params_per_s=1e9)
    return Profile(blocks, BlockProfile("rest", 0.002, 0.004, 1_000_000, 4 * MiB, 2 * MiB), machine)


def problem(profile: Profile, device: float, host: int = 1 << 40, levels: int = 64) -> Problem:
    return Problem(profile, Budgets(device=int(device), host=host, disk=1 << 40), levels=levels)


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_programming_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    n = 3 if seed % 2 else 4
    prof = synthetic(n, rng)
    device = rng.uniform(40, 140) * MiB
    pb = problem(prof, device)
    want, got = exhaustive(pb), dynamic_programming(pb)
    assert (want is None) == (got is None)
    if want is not None:
        assert got.seconds == pytest.approx(want.seconds, rel=1e-12)
        for other in (greedy(pb), random_search(pb, samples=64, seed=seed)):
            assert other is None or other.seconds >= got.seconds - 1e-12


def test_greedy_and_random_never_beat_dp_on_larger_models():
    for seed in range(10):
        rng = random.Random(seed)
        pb = problem(synthetic(12, rng), rng.uniform(60, 400) * MiB)
        best = dynamic_programming(pb)
        for other in (greedy(pb), random_search(pb, seed=seed), stronghold(pb)):
            if other is not None:
                assert best is not None and other.seconds >= best.seconds - 1e-12


BUDGETS = (60, 90, 120, 160, 250, 400, 600)  # MiB beside autograd's gradient of a block: from tight to loose


def _budget(profile: Profile, mib: int) -> int:
    return mib * MiB + profile.grad_transient_bytes


def _counts(profile: Profile) -> list[tuple[int, int, int]]:
    """Per budget: (transfer switches: stream + offload_hidden, recompute, all switches) of the DP plan."""
    out = []
    for mib in BUDGETS:
        s = dynamic_programming(problem(profile, _budget(profile, mib)))
        assert s is not None
        transfer = sum(c.stream + c.offload_hidden for c in s.choices)
        recompute = sum(c.recompute for c in s.choices)
        out.append((transfer, recompute, transfer + recompute))
    return out


def _link_bytes(profile: Profile) -> list[int]:
    """Per budget: bytes the DP plan moves over the host<->device link in a step: streamed params
    in (forward and backward), stashes out and back, and, for blocks whose states are off the
    device, gradients out and (resident blocks) new params back."""
    from tiertrain.planner.costs import saved_bytes

    out = []
    for mib in BUDGETS:
        s = dynamic_programming(problem(profile, _budget(profile, mib)))
        total = 0
        for b, c in zip(profile.blocks, s.choices):
            total += 2 * b.params * 4 * c.stream + 2 * saved_bytes(b, c) * c.offload_hidden
            total += 0 if c.device_home else b.params * 4 * (1 if c.stream else 2)
        out.append(total)
    return out


def test_h3t_case_study_directions():
    """H3T App. D.5 (Table 6) in kind: a 10x slower host<->device link cuts the plan's link traffic
    (device-homed states keep gradients off the link, so that is measured in bytes, not in
    switches); 10x slower compute turns offloading on in place of recompute; looser memory, fewer
    switches."""
    base, slow_compute = _counts(synthetic(12)), _counts(synthetic(12, compute_scale=10))
    link, slow_link = _link_bytes(synthetic(12)), _link_bytes(synthetic(12, link_scale=10))
    assert all(s <= b for s, b in zip(slow_link, link)) and any(s < b for s, b in zip(slow_link, link))
    assert all(s[0] >= b[0] for s, b in zip(slow_compute, base)) and any(s[0] > b[0] for s, b in zip(slow_compute, base))
    assert all(s[1] <= b[1] for s, b in zip(slow_compute, base)) and sum(s[1] for s in slow_compute) < sum(b[1] for b in base)
    switches = [b[2] for b in base]
    assert switches == sorted(switches, reverse=True) and switches[0] > switches[-1] == 0


def test_dp_for_100_blocks_and_128_levels_is_fast_enough_to_report():
    """Solver speed is a benchmark figure (``tiertrain bench planner``); here only that it finishes
    and fits: 100 blocks, m=128, all 16 switch settings per block."""
    pb = Problem(synthetic(100, random.Random(1)), Budgets(device=2000 * MiB, host=1 << 40, disk=1 << 40), levels=128)
    s = dynamic_programming(pb)
    assert s is not None and len(s.choices) == 100


def test_tiertrain_plan_writes_a_plan_that_trains_within_its_budgets(tmp_path):
    import json

    from conftest import read_metrics, run_cli
    from tiertrain.plan import Plan

    plan_file, png = tmp_path / "plan.json", tmp_path / "step.png"
    r = run_cli("plan", "--model", "tiny", "--batch", "4", "--seq", "32", "--device-memory", "4MiB",
                "--host-memory", "256MiB", "--page-size", "64KiB", "--out", str(plan_file), "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert "predicted step" in r.stdout and "bottleneck" in r.stdout and "greedy" in r.stdout
    plan = Plan.from_json(plan_file.read_text()).validate(2)
    assert plan.name.startswith("auto/") and png.stat().st_size > 10_000
    r = run_cli("train", "--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--plan",
                str(plan_file), "--device-memory", "4MiB", "--host-memory", "256MiB", "--page-size", "64KiB",
                "--out", str(tmp_path / "run"),
                "--quiet")
    assert r.returncode == 0, r.stderr
    assert read_metrics(tmp_path / "run")[-1]["peak_bytes"]["device"] <= 4 << 20
    # Budgets nothing fits: one line, exit 2, and the smallest device budget that would work.
    r = run_cli("plan", "--model", "tiny", "--batch", "4", "--seq", "32", "--device-memory", "64KiB",
                "--host-memory", "256MiB", "--out", str(tmp_path / "none.json"))
    assert r.returncode == 2 and "no plan fits" in r.stderr and "would" in r.stderr
    assert not (tmp_path / "none.json").exists()
    assert json.loads(plan_file.read_text())["blocks"]  # the earlier plan is untouched


def test_tiertrain_plan_plans_for_the_runs_update_mode_as_plan_auto_does(tmp_path):
    """The gradients a run holds depend on its update mode and clipping. ``tiertrain plan`` takes
    the run's --update, --grad-clip and --grad-accum and plans as ``--plan auto`` in train would:
    a host smaller than the fp32 weights fits only a run that updates gradients away as they come,
    and both refusals say so; the plan file then trains with its update mode."""
    import dataclasses
    import json

    import torch

    import tiertrain
    from conftest import read_metrics, run_cli
    from tiertrain.autoplan.auto_plan import auto_plan
    from tiertrain.memory import Budgets, Tier
    from tiertrain.models import ModelConfig, build
    from tiertrain.plan import Plan
    from tiertrain.plan.fit import PlanDoesNotFit, resolve
    from tiertrain.runtime.blocks import block_sizes, find_blocks

    (tmp_path / "disk").mkdir()
    model = tmp_path / "thin.json"  # 4.8M params: 18.3 MiB of fp32 weights
    model.write_text(json.dumps({"name": "thin", "n_layer": 24, "n_head": 4, "d_model": 128, "d_ffn": 512,
                                 "vocab_size": 256, "max_seq_len": 64}))
    budgets = ["--device-memory", "8MiB", "--host-memory", "12MiB", "--disk", f"{tmp_path / 'disk'}:1GiB",
               "--page-size", "64KiB"]
    plan_cli = ["plan", "--model", str(model), "--batch", "2", "--seq", "32", *budgets]
    away = ["--update", "overlap", "--grad-clip", "0"]
    r = run_cli(*plan_cli, "--out", str(tmp_path / "all.json"))  # train's defaults: sync, clipped
    assert r.returncode == 2 and "no plan fits" in r.stderr and "--update overlap --grad-clip 0" in r.stderr
    assert "or a disk" not in r.stderr  # it has one
    r = run_cli(*plan_cli, *away, "--out", str(tmp_path / "away.json"))
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json((tmp_path / "away.json").read_text())
    assert plan.update == "overlap" and any(b.home is Tier.DISK for b in plan.blocks)
    # the later --host-memory wins. (At 64 MiB the planner once answered with a lockfree plan the runtime
    # counts at 78 MiB: a disk-homed master an update loop moves keeps an fp32 param home on the host.)
    r = run_cli(*plan_cli, "--host-memory", "80MiB", "--update", "lockfree", "--grad-clip", "0", "--max-staleness", "3",
                "--out", str(tmp_path / "lockfree.json"))
    assert r.returncode == 0, r.stderr
    lockfree = Plan.from_json((tmp_path / "lockfree.json").read_text())
    assert (lockfree.update, lockfree.max_staleness) == ("lockfree", 3)
    sizes = block_sizes(find_blocks(build(ModelConfig.from_dict(json.loads(model.read_text())), device="meta")))
    assert resolve(lockfree, sizes, Budgets(8 * MiB, 80 * MiB, 1 << 30), 64 << 10) == lockfree  # what setup runs
    # the plan file says overlap: without --update the run takes it from there, and trains
    r = run_cli("train", "--model", str(model), "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--quiet",
                *budgets, "--plan", str(tmp_path / "away.json"), "--grad-clip", "0", "--out", str(tmp_path / "file"))
    assert r.returncode == 0, r.stderr
    assert len(read_metrics(tmp_path / "file")) == 2
    ran = Plan.from_json((tmp_path / "file" / "plan.json").read_text())
    # the run may read more blocks ahead than planned where the host has room (widest_read_ahead)
    assert dataclasses.replace(ran, read_ahead=plan.read_ahead) == plan
    # train's --plan auto chooses that plan (same cached profile); the runtime refuses it for sync, saying why
    meta = build(ModelConfig.from_dict(json.loads(model.read_text())), device="meta")
    step = lambda: None  # noqa: E731 - a meta model never runs its profile step
    step.shape = (2, 32)
    have = Budgets(8 * MiB, 12 * MiB, 1 << 30, str(tmp_path / "disk"))
    auto = auto_plan(meta, step, have, 64 << 10, "fp32", "overlap", needs_all_grads=False)
    assert auto.plan == plan
    with pytest.raises(PlanDoesNotFit, match="--update overlap --grad-clip 0"):
        tiertrain.setup(meta, torch.optim.AdamW(meta.parameters(), lr=1e-3), have, plan=plan, update="sync",
                        page_size=64 << 10)


def _tiny_gpt(layers: int = 3):
    import torch

    from tiertrain.models import ModelConfig, build

    torch.manual_seed(0)
    return build(ModelConfig(n_layer=layers, n_head=4, d_model=64, d_ffn=256, vocab_size=256, max_seq_len=64, name="t"))


def _measured(model, batch: int = 4, seq: int = 32, page: int = 64 << 10):
    import torch

    from tiertrain.train.objective import lm_loss
    from tiertrain.measure.model import measure_profile
    from tiertrain.runtime.blocks import find_blocks

    x = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    machine = MachineProfile(h2d_bps=1e10, d2h_bps=1e10, disk_read_bps=1e9, disk_write_bps=1e9,
                             adam_params_per_s=1e9, device_is_host=True)
    return measure_profile(model, find_blocks(model), lambda: lm_loss(model, x[:, :-1], x[:, 1:]).backward(),
                           machine, "fp32", "test", page, steps=2)


def test_the_profiler_measures_each_block_and_leaves_the_model_as_it_was():
    """Input bytes exactly b*s*d*4; saved bytes above that; every time positive; the call order;
    no hook, checkpoint wrapper or gradient left behind."""
    import torch

    model = _tiny_gpt(3)
    before = [p.detach().clone() for p in model.parameters()]
    prof = _measured(model)
    assert [b.name for b in prof.blocks] == ["blocks.0", "blocks.1", "blocks.2"] and prof.order == (0, 1, 2)
    for b in prof.blocks:
        assert b.hidden_bytes == 4 * 32 * 64 * 4
        assert b.act_bytes > 4 * b.hidden_bytes            # q, k, v, attention, the MLP's 4x wide hidden...
        assert b.forward_s > 0 and b.backward_s > 0 and b.recompute_s is not None and b.recompute_s > 0
        assert b.params == sum(p.numel() for p in model.blocks[0].parameters())
    assert prof.rest.act_bytes > 0 and prof.page == 64 << 10
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "forward" not in vars(model.blocks[0])             # the checkpoint wrapper is gone
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_profiles_are_cached_per_key_and_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    from tiertrain.measure import cache
    from conftest import load_meter
    from tiertrain.measure import model as profiling

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path))
    others = {"cores": 0.0}  # what else ran while each profile was measured
    monkeypatch.setattr(profiling, "LoadMeter", load_meter(others))
    others["cores"] = 1.2  # a busy machine: measured, used, not kept
    busy, cached = profiling.cached_profile("k1", lambda: Profile(synthetic(2).blocks, synthetic(2).rest,
                                                                 synthetic(2).machine, key="k1"))
    assert not cached and busy.key == "k1" and cache.load("profiles", "k1") is None
    others["cores"] = 0.05
    calls = []

    def measure():
        calls.append(1)
        return Profile(synthetic(2).blocks, synthetic(2).rest, synthetic(2).machine, key="k1")

    first, cached = profiling.cached_profile("k1", measure)
    assert not cached and len(calls) == 1
    again, cached = profiling.cached_profile("k1", measure)
    assert cached and len(calls) == 1 and again == first
    cache._path("profiles", "k1").write_text("{ not json")
    _, cached = profiling.cached_profile("k1", measure)
    assert not cached and len(calls) == 2


def test_every_solver_plan_fits_the_runtime_check_and_runs_within_its_device_budget():
    """Plans from a measured profile over a sweep of device budgets, from one slot to all resident:
    the runtime's own count accepts every solver's plan at every budget (one accounting of bytes on
    both sides, pages included), and plans that stream run two steps within the budget."""
    import dataclasses

    import torch

    import tiertrain
    from tiertrain.train.objective import lm_loss
    from tiertrain.train.optimizer import make_adamw
    from tiertrain.memory import Budgets, Tier
    from tiertrain.planner.auto import candidates
    from tiertrain.planner.costs import working_bytes
    from tiertrain.planner.solvers import SOLVERS
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    page = 64 << 10
    model = _tiny_gpt(4)
    prof, blocks = _measured(model, page=page), find_blocks(model)
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(2))
    block, rest = prof.blocks[0].params * 4, prof.rest.params * 4
    # the least the compute holds beside the pool: every block recomputed (``costs.activation_bytes``)
    acts = working_bytes(prof) + prof.rest.act_bytes + sum(b.hidden_bytes for b in prof.blocks)
    checked, ran = 0, 0
    for step in range(24):
        device = block + rest + acts + step * page
        pb = Problem(prof, Budgets(device=device, host=256 * MiB, disk=0))
        for cand in candidates(pb, update="sync", solvers=tuple(SOLVERS)):
            if cand.plan is None:
                continue
            assert needs(blocks, cand.plan, page)[Tier.DEVICE] + cand.plan.beside_pool <= device, (device, cand.solver)
            assert cand.plan.beside_pool >= acts
            assert cand.sim.peaks["device"] <= device
            checked += 1
            if ran < 2 and any(b.stream for b in cand.plan.blocks):
                fresh = _tiny_gpt(4)
                opt, _ = make_adamw(fresh, 1e-3, (0.9, 0.95), 1e-8, 0.1)
                tm, topt = tiertrain.setup(fresh, opt, Budgets(device=device, host=256 * MiB),
                                           plan=dataclasses.replace(cand.plan, name=cand.solver), page_size=page)
                try:
                    for _ in range(2):
                        lm_loss(tm, x[:, :-1], x[:, 1:]).backward()
                        topt.step()
                        topt.zero_grad()
                    assert tm.runtime.mem.stats()["device"]["pages_peak_bytes"] <= device
                finally:
                    tm.runtime.close()
                    tm.runtime.mem.close()
                ran += 1
    assert checked >= 40 and ran == 2


@pytest.mark.parametrize("staleness", [0, 3])
def test_lockfree_plans_count_the_gradients_a_block_holds_while_its_update_lags(staleness):
    """With staleness allowed, a lockfree block may hold two gradient chunks: the one its update loop
    is applying and the one backward fills meanwhile. The solvers count both, so over a sweep of host
    budgets every lockfree plan they choose is one the runtime's check accepts, on the host and on
    the device (device-homed blocks keep theirs there), carrying the staleness it was counted for."""
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.plan.update_modes import grad_copies
    from tiertrain.planner.auto import candidates
    from tiertrain.planner.costs import working_bytes
    from tiertrain.planner.solvers import SOLVERS
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    page = 64 << 10
    model = _tiny_gpt(4)
    prof = dataclasses.replace(_measured(model, page=page), grad_copies=grad_copies("lockfree", staleness))
    blocks = find_blocks(model)
    total = sum(b.params for b in (*prof.blocks, prof.rest)) * 4
    checked = 0
    for k, d in ((k, d) for k in range(12, 30) for d in (1, 4)):  # chunks of whole pages: small blocks need more
        host, device = k * total // 2, d * total
        pb = Problem(prof, Budgets(device=device, host=host, disk=0))
        for cand in candidates(pb, update="lockfree", solvers=tuple(SOLVERS), max_staleness=staleness):
            if cand.plan is None:
                continue
            need = needs(blocks, cand.plan, page)
            assert cand.plan.max_staleness == staleness
            assert need[Tier.HOST] <= host and need[Tier.DEVICE] <= device, (k, cand.solver, need)
            checked += 1
    assert checked >= 20


def test_auto_plans_a_host_smaller_than_the_weights_when_gradients_are_updated_away(tmp_path, monkeypatch):
    """Overlap without clipping updates each block's gradients away as backward flushes them, so
    the host holds a few gradient chunks, not all (``plan_bytes``' transient rule). The solvers count
    it so, and fall back to one worker and one block read ahead when the default disk pipeline does
    not fit: a model whose fp32 weights exceed the host budget is planned onto disk, the runtime's
    check accepts the plan, and it trains (built on the meta device, as train builds it). With host
    for the default pipeline, that pipeline fits without the fallback (the planner may still prefer
    the lean one for the masters it leaves room for: ``auto._pipelines``)."""
    import dataclasses

    import torch

    import tiertrain
    from conftest import train_losses
    import tiertrain.planner.auto as auto
    from tiertrain.memory import Budgets, Tier
    from tiertrain.models import ModelConfig, build
    from tiertrain.planner.auto import NoPlanFits, choose
    from tiertrain.measure.analytic import analytic_profile
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    cfg = ModelConfig(n_layer=24, n_head=4, d_model=128, d_ffn=512, vocab_size=256, max_seq_len=64, name="thin")
    page, disk = 64 << 10, 1 << 30
    blocks = find_blocks(build(cfg, device="meta"))
    weights = 4 * sum(p.numel() for b in blocks for _, p in b.params)
    prof = dataclasses.replace(analytic_profile(cfg, 2, 32, "fp32", str(tmp_path)), page=page)
    lean = dataclasses.replace(prof, transient_grads=True)
    with pytest.raises(NoPlanFits):  # counting every gradient in host: nothing fits
        choose(Problem(prof, Budgets(device=8 * MiB, host=weights * 2 // 3, disk=disk)))
    for host, workers in ((weights * 2 // 3, 1), (2 * weights, 2)):
        with monkeypatch.context() as m:
            m.setattr(auto, "_pipelines", lambda plan, *_: [plan])  # the pipeline found, not the lean variant
            chosen, _ = choose(Problem(lean, Budgets(device=8 * MiB, host=host, disk=disk)))
        plan = chosen.plan
        assert (plan.read_ahead, plan.update_workers) == ((1, 1) if workers == 1 else (2, 2)), host
        assert any(b.home is Tier.DISK for b in plan.blocks)
        need = needs(blocks, plan, page, transient_grads=True)
        assert need[Tier.HOST] <= host and need[Tier.DEVICE] <= 8 * MiB and need[Tier.DISK] <= disk
    model = build(cfg, device="meta")
    step = lambda: None  # noqa: E731 - a meta model is planned from its config; this never runs
    step.shape = (2, 32)
    tm, topt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               Budgets(8 * MiB, weights * 2 // 3, disk, str(tmp_path / "disk")), plan="auto",
                               update="overlap", profile_step=step, page_size=page)
    assert tm.runtime.plan.update_workers == 1
    assert tm.runtime.plan == tm.auto_plan.plan  # the plan simulated is the plan that runs (plan.fit.resolve)
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = train_losses(tm, topt, [x] * 3)
    assert losses[-1] < losses[0]


def test_plan_auto_runs_the_plan_it_simulated_field_for_field(tmp_path):
    """The planner resolves every plan before it simulates it (``plan.fit.resolve``: pieces where the host
    cannot hold whole blocks' states, the read-ahead the host leaves room for, whether backward waits for
    updates to free gradient chunks, the device pool's count) and setup resolves the plan it is given, once
    more, to the same plan: what plan auto predicted is what the runtime runs. Hosts from two thirds of
    the fp32 weights to 16 times them: gradients bounded and not, one block read ahead and two."""
    import torch

    import tiertrain
    from tiertrain.memory import Tier
    from tiertrain.models import ModelConfig, build
    from tiertrain.runtime.blocks import find_blocks

    cfg = ModelConfig(n_layer=24, n_head=4, d_model=128, d_ffn=512, vocab_size=256, max_seq_len=64, name="thin")
    weights = 4 * sum(p.numel() for b in find_blocks(build(cfg, device="meta")) for _, p in b.params)
    step = lambda: None  # noqa: E731 - a meta model is planned from its config; this never runs
    step.shape = (2, 32)
    decided = set()
    for host in (weights * 2 // 3, 4 * weights, 16 * weights):
        model = build(cfg, device="meta")
        tm, _ = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                Budgets(8 * MiB, host, 1 << 30, str(tmp_path / "disk")), plan="auto",
                                update="overlap", profile_step=step, page_size=64 << 10)
        try:
            ran, chosen = tm.runtime.plan, tm.auto_plan.plan
            assert chosen.resolved is not None and ran == chosen
            assert tm.runtime.mem.pool(Tier.DEVICE).capacity == ran.resolved.device
            assert tm.runtime.bounded_grads is ran.resolved.bounded
            decided.add((ran.resolved.grads, ran.read_ahead))
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()
    assert {g for g, _ in decided} == {"bounded", "transient"} and len({r for _, r in decided}) == 2, decided


def test_the_planner_counts_transient_gradients_as_the_runtime_does_with_a_wide_embedding(tmp_path):
    """With a wide vocabulary the rest block's gradient chunk outweighs the blocks'. The planner
    counts the few chunks an overlapped run keeps as the runtime's check does (the largest
    ``update_workers + 1``), so at exactly the host a plan it chose needs, it still finds one with
    the same pipeline."""
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.models import ModelConfig, build
    from tiertrain.planner.auto import choose, run_profile
    from tiertrain.measure.analytic import analytic_profile
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    cfg = ModelConfig(n_layer=8, n_head=4, d_model=128, d_ffn=512, vocab_size=16384, max_seq_len=64, name="wide")
    page = 64 << 10
    blocks = find_blocks(build(cfg, device="meta"))
    prof = run_profile(dataclasses.replace(analytic_profile(cfg, 2, 32, "fp32", str(tmp_path)), page=page),
                       "overlap", 1, needs_all_grads=False)
    assert prof.rest.params > sum(b.params for b in prof.blocks)
    device = 32 * MiB  # the rest's weights, their logits (8 MiB each) and a block in flight
    chosen, _ = choose(Problem(prof, Budgets(device=device, host=1 << 30, disk=1 << 30)))
    need = needs(blocks, chosen.plan, page, transient_grads=True)[Tier.HOST]
    again, _ = choose(Problem(prof, Budgets(device=device, host=need, disk=1 << 30)))
    assert needs(blocks, again.plan, page, transient_grads=True)[Tier.HOST] <= need
    # found with the same pipeline, not only after falling back to one worker and one block read ahead
    assert (again.plan.update_workers, again.plan.read_ahead) == (chosen.plan.update_workers, chosen.plan.read_ahead)


def test_on_a_cpu_only_machine_the_lanes_share_the_cores():
    """With the device in host RAM, copies, updates and compute add up; with an accelerator they overlap.
    The device budget holds the activations on either machine (on a CPU-only one they are in the RAM
    the budgets share out, as the pools are)."""
    import dataclasses

    from tiertrain.plan import builtin_plan
    from tiertrain.planner.simulator import RESOURCES, simulate

    prof = synthetic(6)
    plan = builtin_plan("stream", 6, update="overlap")
    gpu = simulate(plan, prof)
    cpu = simulate(plan, dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, device_is_host=True)))
    total = sum(cpu.timeline.busy(r) for r in RESOURCES)
    assert cpu.step_s == pytest.approx(total) and gpu.step_s < 0.9 * total
    assert cpu.peaks["device"] == gpu.peaks["device"] > simulate(plan, dataclasses.replace(
        prof, blocks=tuple(dataclasses.replace(b, act_bytes=0) for b in prof.blocks))).peaks["device"]


def test_the_simulator_reads_a_disk_master_from_disk_charges_disk_io_to_the_cores_and_publishes_updates():
    """A streamed block whose only fp32 copy is its master on disk is fetched from the disk, one with
    a host param copy over the link. Reads and writes share one disk. On a CPU-only machine the
    disk tier's CPU time (bytes x the probed seconds per byte) is added to the shared cores. A resident
    block whose master is off the device gets its updated params copied into its slot."""
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.plan import BlockPlan, Plan
    from tiertrain.planner.simulator import simulate

    prof = synthetic(4)
    params = sum(b.params for b in prof.blocks)

    def plan(copy: bool) -> Plan:
        b = BlockPlan(home=Tier.DISK, stream=True, param_copy=copy)
        return Plan((b,) * 4, BlockPlan(), window=2, prefetch=1, update="overlap", name="disk")

    def fetch_lanes(sim) -> set:
        return {r for r, _, _, label in sim.timeline.tasks if label.startswith("fetch")}

    assert fetch_lanes(simulate(plan(False), prof)) == {"disk_read"}
    assert fetch_lanes(simulate(plan(True), prof)) == {"h2d"}
    slow = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, disk_read_bps=1e7, disk_write_bps=1e7))
    sim = simulate(plan(True), slow)
    assert sim.step_s >= sim.timeline.busy("disk_read") + sim.timeline.busy("disk_write") - 1e-9
    cpu = dataclasses.replace(prof.machine, device_is_host=True)
    free = simulate(plan(True), dataclasses.replace(prof, machine=cpu))
    costly = simulate(plan(True), dataclasses.replace(prof, machine=dataclasses.replace(cpu, disk_cpu_s_per_byte=1e-9)))
    assert costly.step_s - free.step_s == pytest.approx(2 * 12 * params * 1e-9)  # states read and written

    def publishes(home: Tier, machine, compute_bytes: int = 4) -> int:  # updated params copied into slots
        b = BlockPlan(home=home)
        sim = simulate(Plan((b,) * 4, BlockPlan(), update="overlap", name="r"),
                       dataclasses.replace(prof, machine=machine, compute_dtype={4: "fp32", 2: "bf16"}[compute_bytes]))
        return sum(label.startswith("publish") and r == "h2d" for r, _, _, label in sim.timeline.tasks)

    # on a CPU-only machine a device-homed fp32 block's slot is its master; in bf16 the update copies;
    # the rest (embeddings and head, homed on the host here) is resident too, and published each time
    assert (publishes(Tier.HOST, prof.machine), publishes(Tier.DEVICE, prof.machine), publishes(Tier.DEVICE, cpu),
            publishes(Tier.DEVICE, cpu, 2)) == (5, 1, 1, 5)


def test_the_simulator_charges_a_lockfree_disk_pass_to_the_steps_it_serves():
    """A lockfree disk-homed block's loop waits for max_staleness steps of gradients per pass: each
    step carries that share of the pass's disk traffic and AdamW, in the simulator and in the
    solvers' per-block costs. Where the disk bounds the step, staleness 4 predicts about a quarter
    of its disk time; host-homed blocks pass every step."""
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.plan import BlockPlan, Plan
    from tiertrain.plan.update_modes import disk_passes_per_step
    from tiertrain.planner.costs import Choice, block_seconds
    from tiertrain.planner.simulator import simulate

    prof = synthetic(4)
    prof = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, disk_read_bps=1e8, disk_write_bps=1e8))
    on_disk = Plan((BlockPlan(home=Tier.DISK),) * 4, window=1, prefetch=0, update="lockfree", max_staleness=1)
    disk = lambda sim: sim.timeline.busy("disk_read") + sim.timeline.busy("disk_write")  # noqa: E731
    one, four = simulate(on_disk, prof), simulate(dataclasses.replace(on_disk, max_staleness=4), prof)
    assert disk(four) == pytest.approx(disk(one) / 4)
    assert four.timeline.busy("cpu") < one.timeline.busy("cpu")
    assert one.step_s == pytest.approx(disk(one), rel=0.01) and four.step_s < one.step_s / 2
    on_host = dataclasses.replace(on_disk, blocks=(BlockPlan(home=Tier.HOST),) * 4)
    assert simulate(on_host, prof).step_s == simulate(dataclasses.replace(on_host, max_staleness=4), prof).step_s
    b, resident = prof.blocks[0], Choice(stream=False, recompute=False, offload_hidden=False, device_home=False)
    full, quarter = (block_seconds(b, resident, prof.machine, 4, 1, True, disk_passes_per_step("lockfree", s))
                     for s in (1, 4))
    assert quarter - b.forward_s == pytest.approx((full - b.forward_s) / 4)  # the disk-bound update, amortised


def test_auto_simulates_the_disk_as_the_runs_disk_tier_uses_it(tmp_path):
    """The run's disk tier measured reads and writes at once 1.5x faster than in turns and lets them
    go so (a write share, ``DiskIO``): the plan is simulated with a lane each; without, in turns."""
    import torch

    from tiertrain.autoplan.auto_plan import auto_plan
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets

    model = _tiny_gpt(2)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    budgets = Budgets(device=64 * MiB, host=256 * MiB, disk=256 * MiB, disk_dir=str(tmp_path))
    step = lambda: lm_loss(model, x[:, :-1], x[:, 1:]).backward()  # noqa: E731
    for gain in (1.5, 1.0):
        got = auto_plan(model, step, budgets, 64 << 10, "fp32", "overlap", False, use_cache=False, disk_gain=gain)
        assert got.profile.machine.disk_together_gain == gain
        assert got.prediction.timeline.shared_disk == (gain == 1.0)  # the step replayed on two lanes too


def test_setup_plans_auto_with_the_disk_io_its_memory_system_runs(tmp_path, monkeypatch):
    import torch

    import tiertrain
    from tiertrain.api import setup as setup_module
    from tiertrain.autoplan.auto_plan import ProfileStep
    from tiertrain.measure.disk_depth import DiskIO
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets

    monkeypatch.setattr(setup_module, "disk_io_for", lambda *a: DiskIO(3, 1, 1.25))
    model = _tiny_gpt(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = ProfileStep(model, lm_loss, 256, 2, 16, __import__("contextlib").nullcontext, torch.device("cpu"))
    tm, _ = tiertrain.setup(model, opt, Budgets(64 * MiB, 256 * MiB, 256 * MiB, str(tmp_path)), plan="auto",
                            update="overlap", profile_step=step, page_size=64 << 10)
    try:
        io = tm.runtime.mem.mover._io
        assert (len(io._threads), io._write_share) == (3, 1)
        assert tm.auto_plan.profile.machine.disk_together_gain == 1.25
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_a_plan_that_does_not_fit_is_refused_before_the_disk_is_measured(tmp_path, monkeypatch):
    """Only ``auto`` needs the disk's depth before it plans; a given plan is checked first (measuring
    takes 10-20 s on a disk not measured before)."""
    import pytest
    import torch

    import tiertrain
    from tiertrain.api import setup as setup_module
    from tiertrain.memory import Budgets
    from tiertrain.plan.fit import PlanDoesNotFit

    monkeypatch.setattr(setup_module, "page_size_for", lambda *a, **k: 64 << 10)
    monkeypatch.setattr(setup_module, "disk_io_for", lambda *a: pytest.fail("measured the disk for a refused plan"))
    model = _tiny_gpt(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(PlanDoesNotFit):
        tiertrain.setup(model, opt, Budgets(64 << 10, 64 << 10, 1 << 30, str(tmp_path)), plan="max-offload")


def test_auto_plans_a_lockfree_run_for_the_staleness_it_will_run_with(tmp_path):
    """``--plan auto --update lockfree --max-staleness 4``: the planner counts the gradient chunks and
    the disk passes of that staleness, and the plan it returns carries it."""
    import torch

    from tiertrain.autoplan.auto_plan import auto_plan
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets

    model = _tiny_gpt(2)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    budgets = Budgets(device=64 * MiB, host=256 * MiB, disk=256 * MiB, disk_dir=str(tmp_path))
    got = auto_plan(model, lambda: lm_loss(model, x[:, :-1], x[:, 1:]).backward(), budgets, 64 << 10, "fp32",
                    "lockfree", False, use_cache=False, max_staleness=4)
    assert (got.profile.grad_copies, got.profile.disk_passes, got.plan.max_staleness) == (2, 0.25, 4)
    assert got.plan.update == "lockfree"


def test_setup_with_plan_auto_over_several_ranks_needs_a_profile_step(monkeypatch):
    """One process plans from its first step (tests/test_real_loops.py); ranks that did so might each
    choose another plan from their own timings, so several ranks need a profile function."""
    import torch

    import tiertrain
    from tiertrain.errors import ConfigError
    from tiertrain.memory import Budgets

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = _tiny_gpt(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="over several ranks needs a profile function.*profile_step"):
        tiertrain.setup(model, opt, Budgets(device=64 * MiB, host=256 * MiB), plan="auto")


def test_plan_auto_on_a_model_built_on_the_meta_device_measures_one_block_for_all(tmp_path, monkeypatch, caplog):
    """A model built without memory (``device="meta"``, how one larger than the host is built) cannot
    run a profile step: auto runs a real copy of its first block at the batch shape instead. Every
    block gets what that block saved and took in, byte for byte what profiling the real model finds,
    the profile is cached for the next run, and setup initialises the model; it trains."""
    import torch

    import tiertrain
    from conftest import train_losses
    from tiertrain.measure.model import measure_profile
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig, build
    from tiertrain.runtime.blocks import find_blocks

    def never() -> None:
        raise AssertionError("a meta model cannot run a profile step")

    never.shape = (2, 32)
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(Load, "busy", property(lambda self: False))  # a busy machine's profile is not kept
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=64, d_ffn=256, vocab_size=256, max_seq_len=64, name="t")
    for run in range(2):
        model = build(cfg, device="meta")
        tm, topt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   Budgets(64 * MiB, 256 * MiB), plan="auto", profile_step=never, page_size=64 << 10)
        assert tm.auto_plan.profile_cached is (run == 1)
    got = tm.auto_plan.profile
    assert got.key.endswith("/one-block") and "measuring one of its blocks" in caplog.text
    real = build(cfg)
    x = torch.randint(0, 256, (2, 33))
    want = measure_profile(real, find_blocks(real), lambda: lm_loss(real, x[:, :-1], x[:, 1:]).backward(),
                           got.machine, "fp32", "k", 64 << 10)
    fields = lambda b: (b.params, b.act_bytes, b.hidden_bytes)  # noqa: E731
    assert [fields(b) for b in got.blocks] == [fields(b) for b in want.blocks]
    assert [b.name for b in got.blocks] == [b.name for b in want.blocks]
    assert all(b.forward_s > 0 and b.backward_s > 0 and b.recompute_seconds > 0 for b in got.blocks)
    losses = train_losses(tm, topt, [torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))] * 3)
    assert losses[-1] < losses[0]


def test_one_block_is_run_on_the_inputs_the_model_gives_it_and_nothing_after_it():
    """The first block's inputs come from the model's own forward, stopped at that block: their
    shape is the run's hidden state, and no later block runs (on a meta model nothing could)."""
    import torch

    from tiertrain.measure.one_block import block_inputs, real_copy
    from tiertrain.models import ModelConfig, build

    model = build(ModelConfig(n_layer=3, n_head=4, d_model=64, d_ffn=256, vocab_size=256, max_seq_len=64, name="t"),
                  device="meta")
    later = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: later.append(1))
    args, kwargs = block_inputs(model, model.blocks[0], (3, 20))
    assert [tuple(a.shape) for a in args] == [(3, 20, 64)] and not kwargs and not later
    twin = real_copy(model.blocks[0], torch.device("cpu"))
    assert all(not p.is_meta and torch.isfinite(p).all() for p in twin.parameters())
    assert all(p.is_meta for p in model.blocks[0].parameters())  # the model itself is left as it was


def test_plan_auto_on_a_model_that_does_not_fit_plain_estimates_or_says_what_to_do(tmp_path, caplog, monkeypatch):
    """Profiling runs the plain model on the device; when that runs out of memory, the model is
    planned from one of its blocks (not cached: a later run may fit) and still trains. Where even
    one block does not fit, one of our models is planned from its config's analytic profile, and
    another model gets a clear error."""
    import torch

    import tiertrain
    import tiertrain.measure.one_block as block_profile
    from tiertrain.train.objective import lm_loss
    from tiertrain.errors import ConfigError
    from tiertrain.memory import Budgets

    def out_of_memory() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    out_of_memory.shape = (4, 32)
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    budgets = Budgets(device=64 * MiB, host=256 * MiB)

    def auto(model):
        return tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), budgets, plan="auto",
                               profile_step=out_of_memory, page_size=64 << 10)

    model = _tiny_gpt(2)
    before = [p.detach().clone() for p in model.parameters()]
    tm, topt = auto(model)
    try:
        assert tm.auto_plan.profile.key.endswith("/one-block") and "measuring one of its blocks" in caplog.text
        assert not tm.auto_plan.profile_cached and not list((tmp_path / "cache" / "tiertrain").glob("profiles/*"))  # not kept
        assert all(torch.equal(a, b.detach()) for a, b in zip(before, tm.parameters()))
        x = torch.randint(0, 256, (4, 33))
        lm_loss(tm, x[:, :-1], x[:, 1:]).backward()
        topt.step()
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()

    def block_out_of_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(block_profile, "profile_one_block", block_out_of_memory)
    tm, _ = auto(_tiny_gpt(2))
    tm.runtime.close()
    tm.runtime.mem.close()
    assert tm.auto_plan.profile.key.endswith("analytic") and "analytic profile" in caplog.text
    other = _tiny_gpt(2)
    other.config = None  # not one of our configs: nothing to estimate from
    with pytest.raises(ConfigError, match=r"cannot profile this model \(the plain model does not fit the device\) "
                                          r"and one of its blocks does not fit the device.*--plan max-offload"):
        auto(other)


def test_plan_auto_measures_one_block_of_a_transformers_model_that_does_not_fit_plain(tmp_path, monkeypatch):
    """A transformers model gets the one-block profile too: the block runs on the arguments its own
    forward passes it (built on meta, without the KV cache a transformers model makes by default),
    its head is estimated from its largest matrix; close to profiling the real model, and it trains.
    ``tiertrain plan`` plans it from its config file alike."""
    import torch

    import tiertrain
    from conftest import train_losses
    from tiertrain.train.objective import lm_loss
    from tiertrain.measure.model import measure_profile
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.runtime.blocks import find_blocks
    from tiered_harness import HF_GPT2

    def out_of_memory() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    out_of_memory.shape = (2, 16)
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = build(HF_GPT2)
    tm, topt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), Budgets(64 * MiB, 256 * MiB),
                               plan="auto", profile_step=out_of_memory, page_size=64 << 10)
    got = tm.auto_plan.profile
    assert got.key.endswith("/one-block")
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = train_losses(tm, topt, [x] * 3)
    assert losses[-1] < losses[0]
    real = build(HF_GPT2)
    want = measure_profile(real, find_blocks(real), lambda: lm_loss(real, x[:, :-1], x[:, 1:]).backward(),
                           got.machine, "fp32", "k", 64 << 10)
    assert [(b.params, b.hidden_bytes) for b in got.blocks] == [(b.params, b.hidden_bytes) for b in want.blocks]
    assert all(abs(g.act_bytes / w.act_bytes - 1) < 0.1 for g, w in zip(got.blocks, want.blocks))
    assert got.rest.params == want.rest.params and got.rest.forward_s > 0
    # tiertrain plan profiles it the same way, from its config file
    import json

    from conftest import run_cli

    (tmp_path / "gpt2.json").write_text(json.dumps(HF_GPT2))
    r = run_cli("plan", "--model", str(tmp_path / "gpt2.json"), "--batch", "2", "--seq", "16", "--device-memory",
                "64MiB", "--host-memory", "256MiB", "--page-size", "64KiB", "--out", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    assert "transformer.h.0" in r.stdout and (tmp_path / "plan.json").is_file()


def test_train_plan_auto_trains_like_plain_and_records_the_prediction(tmp_path):
    """--plan auto under a budget that forces streaming: the same losses as plain PyTorch, bitwise;
    the plan it ran in plan.json; after warm-up, each metrics row has the prediction beside the
    measurement."""
    from conftest import read_metrics, run_cli
    from tiertrain.plan import Plan

    common = ["--model", "tiny", "--steps", "5", "--batch-size", "1", "--seq-len", "8", "--quiet"]  # acts < params
    r = run_cli("train", *common, "--out", str(tmp_path / "plain"))
    assert r.returncode == 0, r.stderr
    r = run_cli("train", *common, "--plan", "auto", "--device-memory", "200KiB", "--host-memory", "256MiB",
                "--page-size", "4KiB", "--out", str(tmp_path / "auto"))
    assert r.returncode == 0, r.stderr
    plain, auto = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "auto")
    assert [row["loss"] for row in auto] == [row["loss"] for row in plain]
    plan = Plan.from_json((tmp_path / "auto" / "plan.json").read_text())
    assert plan.name.startswith("auto/") and any(b.stream for b in plan.blocks)
    assert all("predicted" not in row for row in auto[:2])
    for row in auto[2:]:
        assert row["predicted"]["step_s"] > 0 and row["step_s"] > 0
        assert 0 < row["peak_bytes"]["device"] <= plan.resolved.device <= (200 << 10) - plan.beside_pool
        assert row["predicted"]["device_peak"] <= 200 << 10  # the pool and the activations beside it


def test_the_device_memory_a_plan_leaves_becomes_cache_slots_that_save_fetches():
    """Elixir's cache sizing: with room for more slots than the window, a streaming plan gets as many
    cache slots as fit (by the runtime's count too), its prediction no slower and its fetches fewer;
    with no room, none."""
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.plan import builtin_plan
    from tiertrain.plan.fit import tier_bytes
    from tiertrain.planner.auto import size_cache
    from tiertrain.planner.costs import activation_bytes
    from tiertrain.planner.simulator import simulate

    prof = synthetic(8)
    plan = builtin_plan("stream", 8, update="overlap")
    numels = [b.params for b in (*prof.blocks, prof.rest)]
    device = lambda k: tier_bytes(numels, dataclasses.replace(plan, cache=k), 0, grads="none")[Tier.DEVICE]  # noqa: E731

    def fetches(sim) -> int:
        return sum(label.startswith("fetch") for _, _, _, label in sim.timeline.tasks)

    base = simulate(plan, prof)
    acts = activation_bytes(plan, prof)  # beside the pool: what the plan keeps for activations
    room = max(device(3) + acts, simulate(dataclasses.replace(plan, cache=3), prof).peaks["device"])
    sized, sim = size_cache(plan, base, problem(prof, room + 10))
    assert sized.cache == 3 and sim.step_s <= base.step_s and fetches(sim) == fetches(base) - 3
    assert size_cache(plan, base, problem(prof, device(3) + acts - 1))[0].cache == 2
    assert size_cache(plan, base, problem(prof, device(0) + acts))[0].cache == 0


def test_cache_slots_leave_room_for_the_gradients_of_device_homed_blocks():
    """A device-homed block keeps its gradients on the device (two chunks in lockfree). Cache
    sizing counts them as the runtime does: with room for one more slot, but not for the slot and
    those gradients, the plan gets no more slots."""
    import dataclasses

    from tiertrain.memory import Tier
    from tiertrain.plan import BlockPlan, Plan
    from tiertrain.plan.fit import tier_bytes
    from tiertrain.planner.auto import size_cache
    from tiertrain.planner.costs import activation_bytes
    from tiertrain.planner.simulator import simulate

    prof = synthetic(6)
    prof = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, device_is_host=True), grad_copies=2,
                               page=4 * MiB)
    plan = Plan((BlockPlan(home=Tier.DEVICE, stream=True),) * 6, window=2, update="lockfree")
    numels = [b.params for b in (*prof.blocks, prof.rest)]
    need = lambda k, grads: tier_bytes(numels, dataclasses.replace(plan, cache=k), prof.page, grads=grads)[Tier.DEVICE]  # noqa: E731
    room = need(1, "all") + (need(2, "none") - need(1, "none")) // 2  # a slot's worth of room, the gradients' not
    assert need(2, "none") < room < need(2, "all")
    acts = activation_bytes(plan, prof)  # kept beside the pool
    sized, _ = size_cache(plan, simulate(plan, prof), problem(prof, room + acts))
    assert sized.cache == 1


def _cli(*args: str) -> int:
    from tiertrain.cli.main import main

    return main(list(args))


NARROW = {"name": "narrow", "n_layer": 3, "n_head": 4, "d_model": 128, "d_ffn": 512, "vocab_size": 256,
          "max_seq_len": 256}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_block_beyond_the_measurement_bounds_is_measured_at_a_reduced_shape_and_scaled(precision):
    """Fewer rows, then fewer tokens, until the block's run fits the bounds; its saved bytes scaled
    back to the run's shape equal, byte for byte, what the block saves at the run's shape."""
    import torch

    from tiertrain.measure.analytic import saved_bytes
    from tiertrain.measure.bounds import UNBOUNDED, MeasureBounds, run_cost
    from tiertrain.measure.machine import probe
    from tiertrain.measure.one_block import profile_one_block
    from tiertrain.models import ModelConfig, build
    from tiertrain.runtime.blocks import find_blocks

    cfg = ModelConfig.from_dict(NARROW)
    model = build(cfg, device="meta")
    here, cpu = probe(None), torch.device("cpu")
    args = (model, find_blocks(model), cfg, (8, 128), precision, cpu, here, "k")
    full = profile_one_block(*args, bounds=UNBOUNDED)
    params = sum(p.numel() for p in model.blocks[0].parameters())

    def need(b: int, s: int) -> int:  # what measuring at b x s is estimated to hold
        return run_cost(params, precision, saved_bytes(cfg, b, s, precision), b * s * 128 * 4, 0.0, 1, False).memory

    for b, s in ((2, 128), (1, 64), (1, 32)):
        reduced = profile_one_block(*args, bounds=MeasureBounds(need(b, s), 60.0))
        assert f"one block measured at {b} x {s} tokens (of 8 x 128" in reduced.source
        got, want = reduced.blocks[0], full.blocks[0]
        assert (got.act_bytes, got.hidden_bytes, got.params) == (want.act_bytes, want.hidden_bytes, want.params)
        assert got.forward_s > 0 and got.backward_s > 0 and got.flops == want.flops > 0
    assert full.source == "one block measured"


def test_planning_a_model_whose_block_cannot_run_here_completes_from_a_reduced_or_estimated_profile(tmp_path, capsys,
                                                                                                   monkeypatch):
    """`tiertrain plan` under measurement bounds the run's shape is beyond: a reduced shape where one
    fits, the FLOP estimate where even the block's weights do not (memory) or no time is left
    (seconds); each plan completes and says what it came from (each with a cache of its own: a
    measured profile is reused by later runs whatever their bounds)."""
    import json

    model = tmp_path / "narrow.json"
    model.write_text(json.dumps(NARROW))
    common = ["plan", "--model", str(model), "--batch", "8", "--seq", "128", "--device-memory", "64MiB",
              "--host-memory", "1GiB", "--page-size", "64KiB", "--solver", "dp", "--out", str(tmp_path / "p.json")]
    expect = {("--measure-memory", "4MiB"): "one block measured at 1 x 128 tokens",
              ("--measure-memory", "1MiB"): "FLOP estimate",
              ("--measure-seconds", "0"): "FLOP estimate"}
    for k, (flags, said) in enumerate(expect.items()):
        monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / f"cache{k}"))
        assert _cli(*common, *flags) == 0, capsys.readouterr().err
        out = " ".join(capsys.readouterr().out.split())
        assert f"profile: {said}" in out and "predicted step" in out, (flags, out)
        assert "beyond" in out


def test_plan_auto_does_not_run_a_plain_model_beyond_the_bounds():
    """The plain model's profile run is estimated first; beyond the bounds one block is measured in
    its place (the profile step is never called) and the plan says so."""
    import torch

    from tiertrain.autoplan.auto_plan import auto_plan
    from tiertrain.measure.bounds import MeasureBounds
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig, build

    def never() -> None:
        raise AssertionError("the plain model ran beyond the bounds")

    never.shape = (8, 128)
    torch.manual_seed(0)
    model = build(ModelConfig.from_dict(NARROW))
    got = auto_plan(model, never, Budgets(64 * MiB, GiB), 64 << 10, "fp32", "sync", True, use_cache=False,
                    bounds=MeasureBounds(4 * MiB, 60.0))
    assert got.profile.source.startswith("one block measured at 1 x 128 tokens")
    assert "one block measured at 1 x 128" in got.describe()


GiB = 1 << 30


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_analytic_saved_bytes_are_what_our_block_saves(precision):
    """The FLOP estimate's activations: what autograd keeps inside one of our blocks, counted on a real
    block for shapes, widths, heads and MLPs that differ (no s x s scores: attention is SDPA)."""
    import torch

    from tiertrain.measure.analytic import saved_bytes
    from tiertrain.measure.model import _SavedBytes
    from tiertrain.runtime.precision import Precision
    from tiertrain.models import ModelConfig, build

    for d, h, f in ((96, 3, 384), (192, 6, 320), (64, 8, 256)):
        cfg = ModelConfig(n_layer=1, n_head=h, d_model=d, d_ffn=f, vocab_size=256, max_seq_len=512, name="t")
        block = build(cfg).blocks[0]
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        for b, s in ((3, 40), (1, 200)):
            counter = _SavedBytes(params)
            with counter.hooks(), Precision(precision, "cpu").autocast():
                block(torch.randn(b, s, d, requires_grad=True))
            assert saved_bytes(cfg, b, s, precision) == counter.bytes, (d, h, f, b, s)


def test_tiertrain_plan_completes_for_every_named_config(tmp_path, capsys, monkeypatch):
    """Every named model, GPT3-175B included, planned for an 80 GiB device and 1 TiB of host with the
    measurement held to a fraction of a second (the DP's time is a benchmark figure; the probe is kept
    however busy the machine, so it is taken once)."""
    from tiertrain.models import CONFIGS
    from tiertrain.planner.machine import Load

    monkeypatch.setattr(Load, "busy", property(lambda self: False))

    for name in CONFIGS:  # the DP alone (greedy finds none for GPT3-30B; at 128 x 16 levels the DP none for 175B)
        rc = _cli("plan", "--model", name, "--device-memory", "80GiB", "--host-memory", "1TiB", "--disk",
                  f"{tmp_path}:8TiB", "--page-size", "4MiB", "--solver", "dp",
                  "--precision", "bf16", "--update", "overlap", "--grad-clip", "0", "--measure-seconds", "0.3",
                  "--out", str(tmp_path / "p.json"))
        captured = capsys.readouterr()
        assert rc == 0, (name, captured.err)
        assert "predicted step" in captured.out and "profile:" in captured.out, name


def test_a_wrong_cached_probe_is_measured_again_once_the_first_steps_disprove_it(tmp_path, monkeypatch):
    """A cached probe far from this machine (AdamW and copies 100000x too slow) makes plan auto predict
    a step far off. After the first steps the run says so, drops the cached probe and the cached
    profile, probes again in little memory (not kept: the next run probes in full), and from then on
    metrics.jsonl carries the corrected prediction, closer to the measured step, beside the measured
    step and tier peaks."""
    import dataclasses
    import io

    from conftest import read_metrics, tiny_config
    from tiertrain.autoplan.auto_plan import CHECK_AFTER
    from tiertrain.train.loop import WARMUP_STEPS, Trainer
    from tiertrain.measure import cache
    from tiertrain.measure import machine as probing
    from tiertrain.train.metrics import Reporter
    from tiertrain.planner.machine import Load

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(Load, "busy", property(lambda self: False))
    real = probing.probe(None)
    slow = 100_000  # far enough that no load on a shared machine makes the measured steps look like it
    wrong = dataclasses.replace(real, adam_params_per_s=real.adam_params_per_s / slow, h2d_bps=real.h2d_bps / slow,
                                d2h_bps=real.d2h_bps / slow)
    cache.store("machine", probing.probe_key(None), dataclasses.asdict(wrong))
    said = io.StringIO()
    cfg = tiny_config(tmp_path / "run", plan="auto", device_memory="1200KiB", host_memory="256MiB", page_size="4KiB",
                      steps=WARMUP_STEPS + CHECK_AFTER + 1)
    from tiertrain.autoplan import auto_plan
    from tiertrain.runtime.runtime import Runtime

    calls: list[str] = []
    real_wait, real_probe = Runtime.wait_updates, auto_plan.probe
    monkeypatch.setattr(Runtime, "wait_updates", lambda self: calls.append("settle") or real_wait(self))
    scratches: list[int] = []
    monkeypatch.setattr(auto_plan, "probe", lambda *a, **k: calls.append("probe") or scratches.append(
        k.get("scratch", probing.PROBE_SCRATCH)) or real_probe(*a, **k))
    trainer = Trainer(cfg, Reporter(cfg.steps, 1000, stream=said))
    trainer.run()
    last = len(calls) - 1 - calls[::-1].index("probe")  # the probe after the misprediction (not setup's)
    assert last > 0 and calls[last - 1] == "settle"  # the run's own updates and write-backs landed first
    assert trainer.auto.corrected and cache.load("profiles", trainer.auto.profile.key) is None  # measured next run
    rows = read_metrics(tmp_path / "run")
    checked = WARMUP_STEPS + CHECK_AFTER - 1  # the row of the step the prediction is checked at
    before, after = rows[checked - 1]["predicted"], rows[checked]["predicted"]
    assert not before["corrected"] and after["corrected"] and rows[-1]["predicted"] == after
    measured = sorted(r["step_s"] for r in rows[WARMUP_STEPS:checked + 1])[CHECK_AFTER // 2]
    assert abs(after["step_s"] / measured - 1) < abs(before["step_s"] / measured - 1)
    assert set(after["peaks"]) == {"device", "host", "disk"} and "device" in rows[checked]["peak_bytes"]
    text = said.getvalue()
    assert f"auto plan after {CHECK_AFTER} steps" in text and "probed again" in text and "AdamW" in text
    assert scratches[-1] == auto_plan.RECHECK_SCRATCH  # within the run's stated overhead: it holds its budgets
    assert cache.load("machine", probing.probe_key(None)) is None  # that small probe is not kept: the next run probes


def test_a_probe_with_little_scratch_allocates_within_it_and_is_not_kept(tmp_path, monkeypatch):
    """A running plan's recheck probes beside budgets the user sized to the machine: its measurements
    take at most their scratch at once (the process's RSS peak rises by about that, where a whole
    probe's AdamW alone takes 512 MiB), and such a probe is used once, not cached for later runs."""
    from tiertrain.measure import cache
    from tiertrain.measure import machine as probing
    from tiertrain.train.metrics import process_rss, restart_rss_peak
    from tiertrain.planner.machine import Load

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(Load, "busy", property(lambda self: False))
    monkeypatch.setattr("tiertrain.measure.page_size.measured_page_size", lambda *a: 1 << 20)
    rises = {}
    for scratch in (64 << 20, probing.PROBE_SCRATCH):
        if restart_rss_peak() is None:
            pytest.skip("no /proc/self/clear_refs: the RSS peak cannot be restarted here")
        base = process_rss()["now"]
        probing.probe(None, use_cache=False, scratch=scratch)
        rises[scratch] = process_rss()["peak"] - base
        stored = cache.load("machine", probing.probe_key(None))
        assert (stored is not None) == (scratch == probing.PROBE_SCRATCH), scratch
        cache.forget("machine", probing.probe_key(None))
    # the allocator keeps some freed memory (measured: 114 MiB for 64, 668 MiB for 512)
    assert rises[64 << 20] < 2 * (64 << 20) < 400 << 20 < rises[probing.PROBE_SCRATCH], rises


def test_a_misprediction_probes_the_machine_again_only_once_the_runs_own_disk_traffic_has_settled(monkeypatch, tmp_path):
    """The probe after a misprediction is kept for later runs: measured beside the run's own write-backs
    it saw the disk at a fraction of its rate. ``recheck`` settles the run (its ``settle``: the runtime's
    ``wait_updates``) before it probes, and only where it probes."""
    import dataclasses

    from tiertrain.autoplan import auto_plan
    from tiertrain.plan import builtin_plan
    from tiertrain.planner.simulator import simulate

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    order: list[str] = []
    prof = synthetic(4)

    class Probed:
        def rates(self):
            return prof.machine

    monkeypatch.setattr(auto_plan, "probe", lambda *a, **k: order.append("probe") or Probed())
    plan = builtin_plan("stream", 4)
    ran = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, disk_together_gain=1.3))  # the run's disk tier
    sim = simulate(plan, ran)
    auto = auto_plan.AutoPlan(plan, sim, "dp", ran, profile_cached=False)
    close = [sim.step_s] * auto_plan.CHECK_AFTER
    kept, _ = auto_plan.recheck(auto, close, {}, plan, settle=lambda: order.append("settle"))
    assert order == [] and not kept.corrected  # within the margin: nothing probed, nothing waited for
    far = [sim.step_s * 10] * auto_plan.CHECK_AFTER
    fixed, line = auto_plan.recheck(auto, far, {}, plan, settle=lambda: order.append("settle"))
    assert order == ["settle", "probe"] and fixed.corrected and "probed again" in line
    assert fixed.profile.machine.disk_together_gain == 1.3  # the probe's rates, as the run's disk tier uses them


def test_a_transformers_block_with_eager_attention_scales_its_s_by_s_scores_exactly():
    """A transformers GPT-2 whose attention keeps its s x s scores (eager): measured at fewer tokens,
    its saved bytes at the run's sequence come out byte for byte (the fit's quadratic term)."""
    import torch

    from tiered_harness import HF_GPT2
    from tiertrain.measure.bounds import UNBOUNDED, MeasureBounds
    from tiertrain.measure.machine import probe
    from tiertrain.measure.one_block import profile_one_block
    from tiertrain.models import build
    from tiertrain.runtime.blocks import find_blocks

    model = build(dict(HF_GPT2, n_positions=256, _attn_implementation="eager"), device="meta")
    args = (model, find_blocks(model), None, (1, 256), "fp32", torch.device("cpu"), probe(None), "k")
    full = profile_one_block(*args, bounds=UNBOUNDED)
    reduced = profile_one_block(*args, bounds=MeasureBounds(int(0.7 * MiB), 60.0))
    assert "one block measured at 1 x 64 tokens (of 1 x 256" in reduced.source
    assert reduced.blocks[0].act_bytes == full.blocks[0].act_bytes
    assert reduced.blocks[0].act_bytes > 256 * 256 * 2 * 4  # the scores of 2 heads are in it


def test_a_recheck_on_a_busy_cpu_takes_the_blocks_compute_as_long_as_the_cores_left_allow(tmp_path, monkeypatch):
    """The steps ran while another process took one of two cores: the profile was measured on a quieter
    machine, and a new probe reads the links and the optimizer slow but no block, so its prediction alone
    still missed by half (299 ms predicted, 605 ms measured). The recheck takes the blocks' compute as
    twice as long and says why; on a quiet machine it does not."""
    from tiertrain.autoplan import auto_plan as ap
    from tiertrain.measure import machine as probing
    from tiertrain.planner.machine import Load

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_gpt(2)
    step = lambda: lm_step(model)  # noqa: E731
    auto = ap.auto_plan(model, step, Budgets(64 * MiB, 256 * MiB), 64 << 10, "fp32", "sync", needs_all_grads=True)
    quiet = probing.probe(None)
    monkeypatch.setattr(ap, "probe", lambda *a, **k: quiet)
    monkeypatch.setattr(ap, "forget_probe", lambda *a: None)
    measured = [2 * auto.prediction.step_s] * 3
    calm, said_calm = ap.recheck(auto, measured, {}, auto.plan, load=Load(others_cores=0.0, cores=2))
    busy, said_busy = ap.recheck(auto, measured, {}, auto.plan, load=Load(others_cores=1.0, cores=2))
    assert "other processes took 1.0 of 2 cores while the steps ran" in said_busy and "other processes" not in said_calm
    compute = sum(b.forward_s + b.backward_s for b in (*calm.profile.blocks, calm.profile.rest))
    assert sum(b.forward_s + b.backward_s for b in (*busy.profile.blocks, busy.profile.rest)) == pytest.approx(2 * compute)
    assert busy.prediction.step_s > 1.5 * calm.prediction.step_s  # a CPU run's step is mostly its compute


def lm_step(model):
    import torch

    from tiertrain.train.objective import lm_loss

    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    lm_loss(model, x[:, :-1], x[:, 1:]).backward()
    model.zero_grad(set_to_none=True)


def test_tiertrain_plan_sets_its_prediction_beside_the_compute_alone_and_names_a_busy_profile(monkeypatch):
    """The predicted step beside the blocks' own matrix products and attention at the machine's matrix
    rate (the rough 6 x params x tokens / FLOP/s estimate: a 32-minute prediction stood 5x above it with
    nothing said), and a profile measured while other processes took cores named as such (every block
    reads slow), and not cached."""
    import dataclasses

    from tiertrain.cli.plan import explain_step
    from tiertrain.measure import model as measuring
    from tiertrain.measure.load import LoadMeter
    from tiertrain.planner.machine import Load

    p = synthetic(4)
    p = dataclasses.replace(p, blocks=tuple(dataclasses.replace(b, flops=1e9) for b in p.blocks),
                            rest=dataclasses.replace(p.rest, flops=2e9))
    lines = explain_step(0.3, p, 1e11)
    assert p.step_flops == 3 * 6e9 and "0.02 TFLOP a step" in lines[0] and "180.0 ms" in lines[0]
    assert "the predicted step is 1.67x that" in lines[0] and len(lines) == 1
    monkeypatch.setattr(LoadMeter, "__exit__", lambda self, *e: setattr(self, "load", Load(1.2, 2)))
    profile, cached = measuring.cached_profile("busy-key", lambda: p)
    assert profile.busy == 1.2 and not cached and measuring.cache.load("profiles", "busy-key") is None
    assert "other processes took 1.2 cores" in explain_step(0.3, profile, 1e11)[-1]


def test_resolve_leaves_what_a_plan_keeps_for_activations_out_of_the_pools():
    """Plan auto records what the compute holds beside the device pool (``beside_pool``) and the host
    its offloaded activations take (``stash``): resolve spends only the rest of each budget, so a plan
    that fits its pools exactly is refused once it keeps a byte more, saying what it keeps."""
    import dataclasses

    from tiertrain.memory import Budgets, Tier
    from tiertrain.plan import builtin_plan
    from tiertrain.plan.fit import PlanDoesNotFit, resolve, tier_bytes

    sizes, page = [50_000] * 4 + [20_000], 4096
    plan = builtin_plan("stream", 4)
    need = tier_bytes(sizes, plan, page)
    exact = Budgets(device=need[Tier.DEVICE] + 300_000, host=need[Tier.HOST] + 200_000)
    kept = dataclasses.replace(plan, beside_pool=300_000, stash=200_000)
    assert resolve(kept, sizes, exact, page).resolved.device == need[Tier.DEVICE]
    for more in ({"beside_pool": 300_001}, {"stash": 200_001}):
        with pytest.raises(PlanDoesNotFit, match="keeps 29[0-9.]+ KiB of device and 19[0-9.]+ KiB of host"):
            resolve(dataclasses.replace(kept, **more), sizes, exact, page)
