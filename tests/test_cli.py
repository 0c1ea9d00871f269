import json
import signal
import subprocess
import sys
import time


from conftest import read_metrics, run_cli

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32"]


def assert_user_error(result, *phrases):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_unknown_model(tmp_path):
    assert_user_error(run_cli("train", "--model", "gpt9", "--out", str(tmp_path)), "unknown model 'gpt9'", "use one of")


def test_malformed_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: [1, 2\nmodel: tiny\n")
    assert_user_error(run_cli("train", "--config", str(cfg)), "is malformed", "fix the syntax")


def test_config_with_unknown_option_and_wrong_value(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"stepz": 3}))
    assert_user_error(run_cli("train", "--config", str(cfg)), "unknown option 'stepz'", "did you mean 'steps'")
    cfg.write_text(json.dumps({"steps": -1}))
    assert_user_error(run_cli("train", "--config", str(cfg)), "steps must be a positive whole number")


def test_missing_and_empty_data(tmp_path):
    assert_user_error(run_cli("train", *TINY, "--data", str(tmp_path / "nope.bin"), "--out", str(tmp_path / "o")),
                      "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_user_error(run_cli("train", *TINY, "--data", str(empty), "--out", str(tmp_path / "o")), "is empty")


def test_data_shorter_than_one_batch(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert_user_error(run_cli("train", *TINY, "--data", str(short), "--out", str(tmp_path / "o")),
                      "shorter than one batch", "--batch-size")


def test_unwritable_output_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_user_error(run_cli("train", *TINY, "--out", str(blocker / "run")), "not writable", "choose another --out")


def test_checkpoint_from_a_different_model(tmp_path):
    out = tmp_path / "run" / ("a-directory-name-long-enough-to-pass-the-80-columns-of-a-log" * 2)
    ok = run_cli("train", *TINY, "--steps", "2", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert f"resume with     tiertrain train --resume {out} --steps N\n" in ok.stdout  # one line in a log, to copy
    before = (out / "metrics.jsonl").read_text()
    bad = run_cli("train", "--model", "tiny-moe", "--batch-size", "4", "--seq-len", "32", "--steps", "4",
                  "--resume", str(out))
    assert_user_error(bad, "different model", "start a new run")
    assert (out / "metrics.jsonl").read_text() == before


def test_train_from_config_file_with_flag_override_and_resume(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: tiny\nbatch_size: 4\nseq_len: 32\nsteps: 50\nout: {tmp_path / 'run'}\n")
    first = run_cli("train", "--config", str(cfg), "--steps", "3")
    assert first.returncode == 0, first.stderr
    assert "done: 3 steps" in first.stdout and "loss" in first.stdout
    second = run_cli("train", "--config", str(cfg), "--steps", "5", "--resume", str(tmp_path / "run"))
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_resume_alone_continues_the_run_with_the_options_it_was_started_with(tmp_path):
    out = tmp_path / "run"
    first = run_cli("train", *TINY, "--lr", "1e-2", "--grad-clip", "0.5", "--steps", "3", "--out", str(out))
    assert first.returncode == 0, first.stderr
    second = run_cli("train", "--resume", str(out), "--steps", "5")  # as the summary tells the user
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "tiny" in second.stdout
    assert "done: 2 steps (steps 3 -> 5)" in second.stdout and "done: 3 steps in" in first.stdout
    saved = json.loads((out / "checkpoints" / "step-00000005" / "trainer.json").read_text())["run_config"]
    assert (saved["model"], saved["batch_size"], saved["seq_len"], saved["lr"], saved["grad_clip"], saved["steps"]) \
        == ("tiny", 4, 32, 1e-2, 0.5, 5)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_ctrl_c_finishes_the_step_saves_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "tiertrain.cli.main", "train", *TINY, "--steps", "100000",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "stopped early" in stdout
    last = read_metrics(out)[-1]["step"]
    trainer = json.loads((out / "checkpoints" / f"step-{last:08d}" / "trainer.json").read_text())
    assert trainer["step"] == last


def test_info_json_has_params_flops_and_bytes_per_state_kind():
    result = run_cli("info", "--model", "gpt3-175b", "--batch-size", "1", "--seq-len", "2048", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["params"] == 173400471552
    assert set(info["bytes"]) >= {"params", "grads", "optimizer", "activations"}
    assert info["flops_per_token"] > 6 * info["params"]
    assert info["tiers"]["resident"]["device"] == info["bytes"]["total"]


def test_info_table_and_help_read_well():
    table = run_cli("info", "--model", "gpt3-13b")
    assert table.returncode == 0 and "12.85B parameters" in table.stdout and "optimizer" in table.stdout
    helptext = run_cli("train", "--help")
    assert helptext.returncode == 0
    for flag in ("--config", "--model", "--data", "--steps", "--batch-size", "--seq-len", "--grad-accum", "--lr",
                 "--precision", "--seed", "--out", "--resume", "--save-every"):
        assert flag in helptext.stdout


PLAN = ["--plan", "stream", "--device-memory", "8MiB", "--host-memory", "64MiB", "--page-size", "64KiB"]


def test_train_with_a_lockfree_plan_from_the_command_line(tmp_path):
    r = run_cli("train", *TINY, "--steps", "4", "--out", str(tmp_path), *PLAN, "--update", "lockfree",
                "--max-staleness", "1", "--grad-clip", "0")
    assert r.returncode == 0, r.stderr
    assert "plan stream (lockfree)" in r.stdout
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(0 <= row["staleness"] <= 1 and "disk" not in row["peak_bytes"] for row in rows)


def test_a_plan_that_does_not_fit_and_bad_plan_flags(tmp_path):
    small = ["--plan", "resident", "--device-memory", "64KiB", "--page-size", "64KiB"]
    assert_user_error(run_cli("train", *TINY, "--out", str(tmp_path), *small), "does not fit", "Smallest budgets")
    assert_user_error(run_cli("train", *TINY, "--out", str(tmp_path), "--device-memory", "1GiB"),
                      "memory budgets apply to a plan")
    assert_user_error(run_cli("train", *TINY, "--out", str(tmp_path), *PLAN, "--update", "lockfree"),
                      "lockfree updates take gradients as they come")
    assert not (tmp_path / "checkpoints").exists()


def test_the_ranks_command_line_drops_a_flag_and_its_value_however_it_was_written():
    """``train --nproc N`` hands the ranks its command line less ``--nproc`` (and, after planning the stages,
    less ``--plan auto``): ``--flag V`` and ``--flag=V``, every time, and nothing else."""
    from tiertrain.cli.main import _without

    args = ["--model", "tiny", "--plan=auto", "--nproc", "2", "--out", "r", "--plan", "auto", "--steps", "3"]
    assert _without(args, "--plan") == ["--model", "tiny", "--nproc", "2", "--out", "r", "--steps", "3"]
    assert _without(args, "--nproc") == ["--model", "tiny", "--plan=auto", "--out", "r", "--plan", "auto",
                                         "--steps", "3"]
    assert _without(["--planner", "x", "--plan-file", "y"], "--plan") == ["--planner", "x", "--plan-file", "y"]
