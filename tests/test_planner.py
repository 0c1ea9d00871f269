import random

import pytest

from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
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
    return Problem(profile, device=int(device), host=host, disk=1 << 40, levels=levels)


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


BUDGETS = (60, 90, 120, 160, 250, 400, 600)  # MiB: from tight to loose


def _counts(profile: Profile) -> list[tuple[int, int, int]]:
    """Per budget: (transfer switches: stream + offload_hidden, recompute, all switches) of the DP plan."""
    out = []
    for mib in BUDGETS:
        s = dynamic_programming(problem(profile, mib * MiB))
        assert s is not None
        transfer = sum(c.stream + c.offload_hidden for c in s.choices)
        recompute = sum(c.recompute for c in s.choices)
        out.append((transfer, recompute, transfer + recompute))
    return out


def test_h3t_case_study_directions():
    """H3T App. D.5 (Table 6) in kind: a 10x slower host<->device link takes transfer-heavy switches
    off; 10x slower compute turns offloading on in place of recompute; looser memory, fewer switches."""
    base, slow_link, slow_compute = _counts(synthetic(12)), _counts(synthetic(12, link_scale=10)), \
        _counts(synthetic(12, compute_scale=10))
    assert all(s[0] <= b[0] for s, b in zip(slow_link, base)) and any(s[0] < b[0] for s, b in zip(slow_link, base))
    assert all(s[0] >= b[0] for s, b in zip(slow_compute, base)) and any(s[0] > b[0] for s, b in zip(slow_compute, base))
    assert all(s[1] <= b[1] for s, b in zip(slow_compute, base)) and sum(s[1] for s in slow_compute) < sum(b[1] for b in base)
    switches = [b[2] for b in base]
    assert switches == sorted(switches, reverse=True) and switches[0] > switches[-1] == 0


def test_dp_for_100_blocks_and_128_levels_is_fast_enough_to_report():
    """Solver speed is a benchmark figure (``tiertrain bench planner``); here only that it finishes
    and fits: 100 blocks, m=128, all 16 switch settings per block."""
    pb = Problem(synthetic(100, random.Random(1)), device=2000 * MiB, host=1 << 40, disk=1 << 40, levels=128)
    s = dynamic_programming(pb)
    assert s is not None and len(s.choices) == 100


def test_tiertrain_plan_writes_a_plan_that_trains_within_its_budgets(tmp_path):
    import json

    from conftest import read_metrics, run_cli
    from tiertrain.plan import Plan

    plan_file, png = tmp_path / "plan.json", tmp_path / "step.png"
    r = run_cli("plan", "--model", "tiny", "--batch", "4", "--seq", "32", "--device-memory", "4MiB",
                "--host-memory", "256MiB", "--out", str(plan_file), "--png", str(png))
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
