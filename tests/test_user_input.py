"""Every value a user can get wrong, from a flag, a config, a model or plan file, ends in one
`error:` line and exit status 2, with nothing saved before touched (issue 16, items 4, 5 and 7)."""

import contextlib
import json
import math
import os
import shutil
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, tiny_config
from tiertrain import typed
from tiertrain.cli.main import main
from tiertrain.train.loop import Trainer, TrainingDiverged
from tiertrain.errors import ConfigError
from tiertrain.memory.capacity import host_available
from tiertrain.memory.pages import PagesExhausted, PageTable
from tiertrain.plan import Plan, builtin_plan

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--log-every", "1000", "--quiet"]


def user_error(capsys, argv: list[str]) -> str:
    """Run the CLI in this process; it must exit 2 with exactly one `error:` line."""
    code = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


def write(path: Path, data) -> str:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.fixture
def a_finished_run(tmp_path):
    """A run whose files must survive every refused command below."""
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    return out, (out / "metrics.jsonl").read_bytes()


CONFIG_CASES = [
    ({"weight_decay": "x"}, "weight_decay must be a number, got 'x'"),
    ({"steps": True}, "steps must be a whole number, got True"),
    ({"lr": float("inf")}, "lr must be a finite number, got inf"),
    ({"grad_clip": float("nan")}, "grad_clip must be a finite number"),
    ({"steps": 2.7}, "steps must be a whole number, got 2.7"),
    ({"betas": [0.9]}, "betas must hold 2 values"),
    ({"betas": [0.9, 1.5]}, "betas[1] must be < 1"),
    ({"precision": "fp8"}, "precision must be one of fp32, bf16, fp16"),
    ({"warmup_steps": -1}, "warmup_steps must be a whole number >= 0"),
]


@pytest.mark.parametrize("values, phrase", CONFIG_CASES)
def test_bad_config_values_are_refused_before_anything_is_written(capsys, tmp_path, a_finished_run, values, phrase):
    out, metrics = a_finished_run
    cfg = write(tmp_path / "cfg.json", values)
    assert phrase in user_error(capsys, ["train", "--config", cfg, "--out", str(out), "--resume", str(out)])
    assert (out / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("flags, phrase", [
    (["--lr", "inf"], "lr must be a finite number, got inf"),
    (["--lr", "nan"], "lr must be a finite number"),
    (["--grad-clip", "nan"], "grad_clip must be a finite number"),
    (["--lr", "0"], "lr must be > 0"),
    (["--steps", "0"], "steps must be a positive whole number"),
])
def test_bad_flags_are_refused(capsys, tmp_path, flags, phrase):
    assert phrase in user_error(capsys, ["train", *TINY, *flags, "--out", str(tmp_path / "r")])
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


MODEL = {"n_layer": 2, "n_head": 2, "d_model": 64, "d_ffn": 128, "vocab_size": 256, "max_seq_len": 32}
HF = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1, "vocab_size": 256, "n_positions": 32,
      "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("name, model, phrase", [
    ("float width", {**MODEL, "d_model": 64.0}, "d_model must be a whole number, got 64.0"),
    ("bool layers", {**MODEL, "n_layer": True}, "n_layer must be a whole number"),
    ("unknown field", {**MODEL, "n_layers": 2}, "unknown model field 'n_layers' (did you mean 'n_layer'?)"),
    ("hf heads", {**HF, "n_head": 3}, "does not build a model"),
    ("hf width text", {**HF, "n_embd": "big"}, "n_embd"),
    ("yaml", "n_layer: [2\nd_model: 64", "cannot read model config"),
])
def test_bad_model_configs_are_refused(capsys, tmp_path, name, model, phrase):
    path = tmp_path / ("m.yaml" if isinstance(model, str) else "m.json")
    msg = user_error(capsys, ["train", "--model", write(path, model), "--batch-size", "2", "--seq-len", "16",
                              "--out", str(tmp_path / "r"), "--quiet"])
    assert phrase in msg


def _plan_json(mutate) -> dict:
    data = json.loads(builtin_plan("stream", 2).to_json())
    mutate(data)
    return data


@pytest.mark.parametrize("mutate, phrase", [
    (lambda d: d.update(window=1e400), "window must be a whole number, got inf"),
    (lambda d: d.update(window=2.7), "window must be a whole number, got 2.7"),
    (lambda d: d["blocks"][0].update(stream="false"), "stream must be true or false, got 'false'"),
    (lambda d: d.update(windwo=3), "field 'windwo' (did you mean 'window'?)"),
    (lambda d: d["blocks"][1].update(home="ssd"), "home must be one of 'device', 'host', 'disk'"),
    (lambda d: d.update(blocks={}), "blocks must be a list"),
    (lambda d: d.update(update="later"), "update must be one of sync, overlap, lockfree"),
])
def test_bad_plan_files_are_refused_by_name(capsys, tmp_path, mutate, phrase):
    plan = write(tmp_path / "plan.json", json.dumps(_plan_json(mutate)).replace("Infinity", "1e400"))
    assert phrase in user_error(capsys, ["train", *TINY, "--plan", plan, "--out", str(tmp_path / "r")])


def test_a_valid_plan_round_trips_through_the_typed_loader():
    for name in ("resident", "stream", "max-offload"):
        plan = builtin_plan(name, 3, disk=True)
        assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("argv, phrase", [
    (["info", "--model", "tiny", "--batch-size", "-5"], "'--batch-size': must be at least 1, got -5"),
    (["plan", "--model", "tiny", "--batch", "0", "--device-memory", "1GiB", "--host-memory", "1GiB"], "'--batch'"),
    (["plan", "--model", "tiny", "--levels", "0", "--device-memory", "1GiB", "--host-memory", "1GiB"], "'--levels'"),
    (["plan", "--model", "tiny", "--grad-clip", "nan", "--device-memory", "1GiB", "--host-memory", "1GiB",
      "--out", "/nonexistent/never-written.json"], "'--grad-clip'"),
])
def test_bad_numbers_of_the_other_commands_are_one_line(capsys, argv, phrase):
    assert phrase in user_error(capsys, argv)


def test_the_typed_loader_never_coerces_across_kinds():
    assert typed.convert(3, float, "x") == 3.0 and typed.convert([1, 2], tuple[int, ...], "x") == (1, 2)
    for value, hint in [(True, int), (1, bool), ("1", int), (2.5, int), (math.inf, float), (None, int), ([], str)]:
        with pytest.raises(ConfigError, match="x"):
            typed.convert(value, hint, "x")


@pytest.mark.parametrize("budget", ["1000TiB", "2x", "100TiB-4KiB"])
def test_budgets_beyond_the_machine_are_refused_before_anything_is_reserved(capsys, tmp_path, budget):
    host = f"{2 * host_available() >> 30}GiB" if budget == "2x" else budget.split("-")[0]
    pages = ["--page-size", "4KiB"] if budget.endswith("4KiB") else []
    msg = user_error(capsys, ["train", *TINY, "--plan", "stream", "--host-memory", host, *pages,
                              "--out", str(tmp_path / "r")])
    assert "exceed the memory this process can take" in msg and "available now" in msg


def test_a_page_table_costs_the_pages_in_use_not_the_budget():
    tracemalloc.start()
    table = PageTable(n_pages=(1000 << 40) // 4096, page_size=4096, share_pages=True)  # 1000 TiB of 4 KiB pages
    for nbytes in (1 << 20, 5000, 3 << 20):
        table.allocate(nbytes)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20 and table.used_pages == 256 + 2 + 768


def test_the_sparse_page_table_hands_out_what_a_first_fit_bitmap_would():
    import random

    rng = random.Random(7)
    for trial in range(150):
        n = rng.randint(1, 48)
        table, free, live = PageTable(n, 100, share_pages=False), bytearray(b"\x01") * n, []
        for _ in range(150):
            if live and rng.random() < 0.45:
                extents = live.pop(rng.randrange(len(live)))
                table.release(extents)
                for e in extents:
                    free[e.page] = 1
                continue
            k, contiguous = rng.randint(1, 6), rng.random() < 0.5
            first = free.find(b"\x01" * k)
            try:
                extents = table.allocate(k * 100 - rng.randint(0, 99), contiguous)
            except PagesExhausted:
                assert free.count(1) < k or (contiguous and first < 0), trial
                continue
            want = list(range(first, first + k)) if first >= 0 else [i for i, f in enumerate(free) if f][:k]
            assert [e.page for e in extents] == want, trial
            for e in extents:
                free[e.page] = 0
            live.append(extents)
            assert table.free_pages == free.count(1)


@contextlib.contextmanager
def _tmpfs(target: Path, options: str):
    """A tmpfs mounted at ``target`` for the test (root only; skipped elsewhere), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem for this test needs root")
    target.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def read_only_dir(tmp_path):
    with _tmpfs(tmp_path / "ro", "size=64m,ro") as target:
        yield target


@pytest.fixture
def small_disk(tmp_path):
    with _tmpfs(tmp_path / "small", "size=8m") as target:
        yield target


def test_a_disk_directory_that_cannot_be_written_is_one_error(capsys, tmp_path, read_only_dir):
    for pages in (["--page-size", "64KiB"], []):  # the tier's own directory, and the page-size probe
        msg = user_error(capsys, ["train", *TINY, "--plan", "max-offload", "--disk", f"{read_only_dir}:8MiB", *pages,
                                  "--out", str(tmp_path / "r")])
        assert "cannot be written" in msg and str(read_only_dir) in msg


def test_a_disk_directory_under_a_missing_one_is_refused_and_nothing_is_created(capsys, tmp_path):
    """A typo or a disk not mounted (/nvme/tt with no /nvme) must not put the disk tier on another
    filesystem: the named directory is created only where its parent exists."""
    missing = tmp_path / "not-mounted" / "tt"
    for pages in (["--page-size", "64KiB"], []):  # the tier's own directory, and the page-size probe
        msg = user_error(capsys, ["train", *TINY, "--plan", "max-offload", "--disk", f"{missing}:8MiB", *pages,
                                  "--out", str(tmp_path / "r")])
        assert f"disk directory {missing} does not exist, nor does {missing.parent}: is the disk mounted?" in msg
        assert not missing.parent.exists()
    assert main(["train", *TINY, "--steps", "1", "--plan", "max-offload", "--disk", f"{tmp_path / 'new'}:8MiB",
                 "--page-size", "64KiB", "--out", str(tmp_path / "ok")]) == 0
    assert (tmp_path / "new").is_dir()


def test_plan_out_on_a_read_only_filesystem_is_one_error(capsys, read_only_dir):
    msg = user_error(capsys, ["plan", "--model", "tiny", "--device-memory", "1GiB", "--host-memory", "1GiB",
                              "--out", str(read_only_dir / "plan.json"), "--solver", "greedy"])
    assert "cannot write" in msg


def test_the_page_size_probe_on_a_full_disk_is_one_error_and_leaves_no_file(capsys, tmp_path, small_disk):
    # a model whose chunks take pages the probe measures (a tiny one's take smaller pages: nothing is measured)
    msg = user_error(capsys, ["train", *TINY, "--model", "gpt-small", "--plan", "max-offload", "--disk",
                              f"{small_disk}:1MiB", "--out", str(tmp_path / "r")])
    assert "measuring the disk" in msg and "--page-size" in msg
    assert list(small_disk.iterdir()) == []


def test_the_disk_tier_removes_only_directories_it_can_prove_it_made(tmp_path):
    from tiertrain.memory.disk import MARKER, DiskDir

    root = tmp_path / "disk"
    root.mkdir()
    user_data = root / "tiertrain-run-mine"                          # the user's, with a look-alike owner file
    user_data.mkdir()
    (user_data / "owner.json").write_text(json.dumps({"pid": 999999999, "start": 1}))
    (user_data / "pages.bin").write_text("precious")
    extra = root / "tiertrain-run-extra"                             # a marker, but a file the tier never writes
    extra.mkdir()
    (extra / "owner.json").write_text(json.dumps({"marker": MARKER, "pid": 999999999, "start": 1, "host":
                                                  os.uname().nodename, "uid": os.getuid()}))
    (extra / "notes.txt").write_text("also precious")
    (extra / "pages.bin").write_text("pages the user keeps beside their notes")
    crashed = DiskDir(root)                                          # a real one, then abandoned
    crashed._finalizer.detach()
    owner = json.loads((crashed.path / "owner.json").read_text())
    (crashed.path / "owner.json").write_text(json.dumps({**owner, "pid": 999999999}))
    (crashed.path / "pages.bin").write_bytes(b"x" * 100)
    fresh = DiskDir(root)
    try:
        assert fresh.stale_removed == [crashed.path] and not crashed.path.exists()
        assert (user_data / "pages.bin").read_text() == "precious" and (extra / "notes.txt").exists()
        assert (extra / "pages.bin").exists() and (extra / "owner.json").exists()
    finally:
        fresh.close()
    assert not fresh.path.exists()


def _all_finite(ckpt: Path) -> bool:
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(ckpt / "model.safetensors").values())


@pytest.mark.parametrize("plan", [None, "stream"])
def test_a_non_finite_loss_stops_the_run_before_any_non_finite_checkpoint(capsys, tmp_path, plan):
    out = tmp_path / "run"
    tiered = ["--plan", plan, "--update", "overlap"] if plan else []
    msg = user_error(capsys, ["train", *TINY, *tiered, "--lr", "1e30", "--grad-clip", "0", "--steps", "8",
                              "--save-every", "1", "--out", str(out)])
    assert "became" in msg and "Lower --lr" in msg
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert ckpts and all(_all_finite(c) for c in ckpts)
    assert len(read_metrics(out)) == int(ckpts[-1].name.split("-")[1])  # no row for the step that diverged


def test_a_non_finite_gradient_norm_starts_no_overlapped_update(tmp_path):
    trainer = Trainer(tiny_config(tmp_path / "run", plan="stream", update="overlap", grad_clip=1.0))
    rt = trainer.model.runtime
    before = [st.master.typed(torch.float32).clone() for st in rt.groups]
    for p in trainer.model.parameters():
        p.register_hook(lambda g: g * math.inf)
    with pytest.raises(TrainingDiverged, match="gradient norm became"):
        trainer.train_step()
    rt.wait_updates()
    assert all(torch.equal(b, st.master.typed(torch.float32)) for b, st in zip(before, rt.groups))
    trainer.close()


def test_auto_with_budgets_too_small_names_the_smallest_that_fit(capsys, tmp_path):
    import re

    msg = user_error(capsys, ["train", *TINY, "--plan", "auto", "--device-memory", "64KiB", "--host-memory", "64KiB",
                              "--page-size", "64KiB", "--out", str(tmp_path / "a")])
    device, host = re.search(r"the smallest budgets that would: device ([\d.]+ \w+) and host ([\d.]+ \w+)", msg).groups()
    assert main(["train", *TINY, "--plan", "auto", "--device-memory", device, "--host-memory", host,
                 "--page-size", "64KiB", "--steps", "2", "--out", str(tmp_path / "b")]) == 0


@pytest.mark.parametrize("kind, fix", [("plan", "tiertrain plan"), ("profile", "--profile FILE"),
                                       ("machine", "tiertrain probe --out FILE")])
def test_a_plan_profile_or_machine_file_that_is_not_json_is_one_error_naming_how_to_write_one(kind, fix):
    from tiertrain.errors import ConfigError
    from tiertrain.plan import Plan
    from tiertrain.planner.machine import Machine
    from tiertrain.planner.profile import Profile

    cls = {"plan": Plan, "profile": Profile, "machine": Machine}[kind]
    with pytest.raises(ConfigError, match=f"{kind} file is not valid JSON .*{fix}"):
        cls.from_json("{not json", f"{kind} file")
