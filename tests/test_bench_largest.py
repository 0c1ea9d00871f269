"""``bench largest``: the search over real runs (against a stand-in runner), the judging of one run,
and one real trial in its own process. The GPU's figure comes from scripts/gpu_check.sh's ``largest``."""

import json
import signal

import pytest

from tiertrain.bench.largest import depth_limit, largest_depth, search
from tiertrain.bench.train_trial import TrainArgs, Trial, judge, run_trial
from tiertrain.models import CONFIGS, param_count
from tiertrain.plan import Budgets

GiB = 1 << 30


@pytest.mark.parametrize("seed", [1, 5, 17, 30, 40, 63])
@pytest.mark.parametrize("answer", [1, 6, 17, 31, 63])
def test_the_depth_search_finds_the_deepest_that_trains_from_any_seed_trying_each_depth_once(seed, answer):
    tried = []

    def trains(n):
        tried.append(n)
        return n <= answer

    best, first_failed = largest_depth(seed, 64, trains, max_trials=20)
    assert (best, first_failed) == (answer, answer + 1 if answer < 63 else 64)
    assert len(tried) == len(set(tried)) and all(1 <= n < 64 for n in tried)


def test_the_depth_search_stops_at_its_trial_limit_with_the_deepest_that_trained_so_far():
    tried = []
    best, first_failed = largest_depth(2, 1000, lambda n: tried.append(n) or n <= 700, max_trials=4)
    assert tried == [2, 3, 5, 9] and (best, first_failed) == (9, 1000)
    tried.clear()
    assert largest_depth(40, 64, lambda n: tried.append(n) or False, max_trials=20) == (None, 1)
    assert tried == [40, 35, 25, 5, 1]


def _seed_and_sizes():
    from tiertrain.autoplan.largest_model import RunShape, largest_model
    from tiertrain.planner.datasheets import find_machine

    sizes = Budgets(device=8 * GiB, host=16 * GiB, disk=16 * GiB)
    run = RunShape(batch=1, seq=512, precision="bf16", update="sync", needs_all_grads=True, max_staleness=1,
                   page=4 << 20)
    return largest_model(find_machine("a100-40gb"), sizes, run), sizes


def test_the_search_seeds_with_max_model_and_reports_the_largest_that_trained_beside_both_bounds(tmp_path):
    seed, sizes = _seed_and_sizes()
    width = seed.cfg.d_model
    threshold = int(1.15 * seed.params)  # the real runs train 15% more than the planner promised
    said = []

    def run(cfg, params):
        assert cfg.d_model == width and params == param_count(cfg)
        ok = params <= threshold
        return Trial(cfg, params, ok, "" if ok else "exit 1: does not fit", 1.5 if ok else None,
                     {"device": 1 << 30}, (10.9, 10.1, 9.8) if ok else (), 2.0)

    found = search(seed, sizes, 512, run, max_trials=12, say=said.append)
    deepest = max(n for n in range(1, depth_limit(width, 512, sizes))
                  if param_count(type(seed.cfg)(**{**seed.cfg.to_dict(), "n_layer": n})) <= threshold)
    assert found.best.cfg.n_layer == deepest and found.first_failed == deepest + 1
    assert found.trials[0].cfg.n_layer == seed.cfg.n_layer
    from tiertrain.bench.largest import report

    report(found, said.append)
    text = "\n".join(said)
    assert f"trial 1: {seed.cfg.n_layer} blocks x width {width}" in text
    assert "did not train: exit 1: does not fit" in text
    line = next(x for x in said if x.startswith("largest that trained"))
    assert f"{found.best.params / found.bound_params:.0%} of the capacity bound (target 90%)" in line
    assert f"{found.best.params / seed.params:.2f}x plan --max-model's answer" in line and "untried" not in line
    found.write_json(tmp_path / "f.json")
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["largest"]["layers"] == deepest and figures["capacity_bound_params"] == found.bound_params
    assert figures["max_model"]["params"] == seed.params and len(figures["trials"]) == len(found.trials)


def test_a_run_trained_only_if_it_exited_cleanly_after_every_step_with_finite_losses():
    cfg = CONFIGS["tiny"]
    rows = [{"loss": 10.0, "step_s": 9.0}, {"loss": 9.0, "step_s": 1.0}, {"loss": 8.5, "step_s": 3.0,
                                                                           "peak_bytes": {"device": 5}}]
    good = judge(cfg, 1, 0, rows, "", 3, 1.0, 60)
    assert good.trained and good.step_s == 2.0 and good.peaks == {"device": 5} and good.losses == (10.0, 9.0, 8.5)
    assert not judge(cfg, 1, 0, rows[:2], "", 3, 1.0, 60).trained
    nan = [*rows[:2], {"loss": float("nan"), "step_s": 1.0}]
    assert not judge(cfg, 1, 0, nan, "", 3, 1.0, 60).trained
    assert judge(cfg, 1, None, rows[:1], "", 3, 1.0, 60).why == "ran past 60 s (step 1 of 3)"
    assert judge(cfg, 1, -signal.SIGKILL, [], "", 3, 1.0, 60).why == "killed by SIGKILL (out of memory?)"
    failed = judge(cfg, 1, 1, [], "warning\nerror: the plan does not fit\n", 3, 1.0, 60)
    assert failed.why == "exit 1: error: the plan does not fit" and not failed.trained and not failed.fatal
    assert not judge(cfg, 1, 2, [], "error: no plan fits device 4.00 GiB", 3, 1.0, 60).fatal  # too large
    assert judge(cfg, 1, 2, [], "error: --seq-len 4096 exceeds the model's maximum", 3, 1.0, 60).fatal


def test_a_trial_refused_for_its_options_ends_the_search_with_its_reason():
    from tiertrain.errors import UserError

    seed, sizes = _seed_and_sizes()
    bad = lambda cfg, params: Trial(cfg, params, False, "exit 2: error: unknown option", fatal=True)  # noqa: E731
    with pytest.raises(UserError, match="trial 1 was refused for another reason than its size .exit 2: error: "
                                        "unknown option.; fix that first"):
        search(seed, sizes, 512, bad, max_trials=6, say=lambda _: None)


def test_a_search_stopped_before_any_failure_says_so():
    from tiertrain.bench.largest import report

    seed, sizes = _seed_and_sizes()
    ok = lambda cfg, params: Trial(cfg, params, True, "", 1.0, {}, (1.0,), 1.0)  # noqa: E731
    found = search(seed, sizes, 512, ok, max_trials=2, say=lambda _: None)
    said = []
    report(found, said.append)
    assert found.first_failed == found.limit and "before any trial failed" in said[-1]
    assert found.figures()["first_failed_layers"] is None


def test_a_real_trial_trains_in_its_own_process_and_leaves_no_files(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "yours").write_text("a file of the user's, beside the trial's pages")
    args = TrainArgs("64MiB", "512MiB", f"{disk}:256MiB", 2, 32, "fp32", 3, 300, device="cpu")
    cfg = CONFIGS["tiny"]
    trial = run_trial(cfg, param_count(cfg), args)
    assert trial.trained, trial.why
    assert len(trial.losses) == 3 and trial.step_s is not None and "host" in trial.peaks
    assert [p.name for p in disk.iterdir()] == ["yours"]
    late = run_trial(cfg, param_count(cfg), TrainArgs("64MiB", "512MiB", None, 2, 32, "fp32", 3, 0.5, device="cpu"))
    assert not late.trained and late.why.startswith("ran past 0 s")


def test_a_trial_trains_with_the_benchs_update_mode_clipping_and_budgets(tmp_path):
    from tiertrain.bench.train_trial import command

    args = TrainArgs("1GiB", "2GiB", f"{tmp_path}:3GiB", 1, 64, "bf16", 3, 60, update="overlap", grad_clip=0.0)
    cmd = command(tmp_path / "m.json", tmp_path / "run", args)
    pairs = {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("--") and not b.startswith("--")}
    assert pairs["--update"] == "overlap" and float(pairs["--grad-clip"]) == 0.0 and pairs["--plan"] == "auto"
    assert pairs["--device-memory"] == "1GiB" and pairs["--disk"] == f"{tmp_path}:3GiB" and "--no-save" in cmd
