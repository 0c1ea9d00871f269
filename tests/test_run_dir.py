"""A run directory belongs to one run at a time, and nothing a run saved is lost to the next:
new runs into a used --out, concurrent runs, torn metrics, refused resumes (issue 16)."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import read_metrics, tiny_config
from tiertrain.cli.main import main
from tiertrain.checkpoint.run import find_checkpoint
from tiertrain.train.loop import Trainer, train
from tiertrain.train.run_dir import RunDirBusy, RunDirTaken

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--log-every", "1000"]


def tree_hash(root: Path, skip: tuple[str, ...] = (".lock",)) -> str:
    """Names, sizes and contents of every file under ``root``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name not in skip:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_new_run_into_a_used_directory_is_refused_until_told_to_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    train(tiny_config(out, steps=10, save_every=5))
    before = tree_hash(out)
    with pytest.raises(RunDirTaken, match="--resume .* --overwrite"):
        Trainer(tiny_config(out, steps=4, save_every=2))
    assert tree_hash(out) == before  # its checkpoints and its metrics untouched
    summary = train(tiny_config(out, steps=4, save_every=2, overwrite=True))
    assert summary.checkpoint.is_dir() and find_checkpoint(out) == summary.checkpoint
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]


def test_metrics_are_appended_and_a_torn_last_line_is_cut_off_on_resume(tmp_path):
    out = tmp_path / "run"
    train(tiny_config(out, steps=4, save_every=2))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.1, "l')  # a run killed in the middle of a row
    summary = train(tiny_config(out, steps=6, resume=str(out)))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert summary.steps == 6


def test_a_refused_resume_changes_no_file_of_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--plan", "stream", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    before = tree_hash(out)
    assert main(["train", "--resume", str(out), "--model", "gpt-small", "--steps", "3", "--quiet"]) == 2
    assert "different model" in one_error_line(capsys)
    assert tree_hash(out) == before  # plan.json above all: it was rewritten for the other model


def test_a_run_that_kept_states_on_disk_resumes_only_with_its_disk_given_again(tmp_path, capsys):
    out, disk = tmp_path / "run", tmp_path / "disk"
    assert main(["train", *TINY, "--steps", "2", "--plan", "max-offload", "--disk", f"{disk}:64MiB",
                 "--page-size", "64KiB", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "3", "--quiet"]) == 2
    assert f"--disk {disk}:64MiB" in one_error_line(capsys)
    assert main(["train", "--resume", str(out), "--steps", "3", "--disk", f"{disk}:64MiB", "--quiet"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_the_lock_is_held_for_the_run_and_released_after_it(tmp_path):
    out = tmp_path / "run"
    first = Trainer(tiny_config(out, steps=2))
    with pytest.raises(RunDirBusy, match=rf"in use by another tiertrain run \(pid {os.getpid()}\)"):
        Trainer(tiny_config(out, steps=2, overwrite=True))
    first.run()
    train(tiny_config(out, steps=3, resume=str(out)))  # released at the end of the run


def test_resuming_a_run_that_still_trains_says_it_is_running_not_that_it_has_no_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    with Trainer(tiny_config(out, steps=2)):  # holds the directory, and has saved nothing yet
        assert main(["train", "--resume", str(out), "--steps", "3", "--quiet"]) == 2
        assert one_error_line(capsys) == (f"error: run directory {out} is in use by another tiertrain run (pid "
                                          f"{os.getpid()}); wait for it to stop (Ctrl-C or SIGTERM saves a "
                                          "checkpoint), then --resume it")
    assert main(["train", "--resume", str(out), "--steps", "3", "--quiet"]) == 2
    assert "no checkpoint" in one_error_line(capsys)  # stopped without one: now that is the news


def test_the_ranks_of_a_resume_testing_the_directory_at_once_do_not_refuse_each_other(tmp_path):
    """Under torchrun every rank of a resume tests the directory it resumes from at the same moment;
    a test in flight (another rank's, here a shared lock held on its own descriptor) is no run."""
    import fcntl

    from tiertrain.train.run_dir import LOCK_FILE, RunDir

    out = tmp_path / "run"
    train(tiny_config(out, steps=1))
    fd = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another rank, mid-test
        RunDir(out).refuse_if_busy()
        RunDir(out).refuse_if_busy()
    finally:
        os.close(fd)
    with Trainer(tiny_config(tmp_path / "running", steps=1)):  # a run holding its directory is still refused
        with pytest.raises(RunDirBusy, match="in use by another tiertrain run"):
            RunDir(tmp_path / "running").refuse_if_busy()


def test_three_concurrent_runs_on_one_directory_one_runs_the_others_are_refused_at_once(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "tiertrain.cli.main", "train", *TINY, "--steps", "800", "--save-every", "200",
            "--out", str(out)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    ended: list[tuple[int, float]] = []  # (index, when)
    start = time.monotonic()
    while len(ended) < 3 and time.monotonic() - start < 300:
        for i, p in enumerate(procs):
            if p.poll() is not None and i not in [e[0] for e in ended]:
                ended.append((i, time.monotonic() - start))
        time.sleep(0.05)
    results = [(p.returncode, *p.communicate()) for p in procs]
    winners = [i for i, r in enumerate(results) if r[0] == 0]
    assert len(winners) == 1, [r[2][-500:] for r in results]
    survivor = winners[0]
    for i, (code, _, err) in enumerate(results):
        if i != survivor:
            assert code == 2 and err.strip().splitlines() == [
                f"error: run directory {out} is in use by another tiertrain run (pid {procs[survivor].pid}); "
                "wait for it to finish, or give another --out"]
    assert ended[-1][0] == survivor  # the others were refused while it still ran
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 801))
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000600", "step-00000800"]
    train(tiny_config(out, steps=801, resume=str(out)))  # its last checkpoint loads
