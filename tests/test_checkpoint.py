import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from tiertrain.cli.main import main
from tiertrain.checkpoint.run import (NEEDED, TrainerState, file_digest, find_checkpoint, load_checkpoint,
                                         save_checkpoint, saved_run_options)
from tiertrain.train.loop import Trainer, train
from tiertrain.errors import CheckpointError, ConfigError, OutputError


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import safetensors.torch
    import tiertrain.checkpoint.run as ck
    from tiertrain.train.config import TrainConfig
    from tiertrain.train.loop import Trainer

    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    real_save = safetensors.torch.save_file

    def slow_save(tensors, path, metadata=None):
        # Write half of the file, tell the parent, and hang: the parent kills us mid-save.
        real_save(tensors, path, metadata=metadata)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        marker.write_text("writing")
        time.sleep(600)

    ck.save_file = slow_save
    cfg = TrainConfig(model="tiny", steps=6, batch_size=4, seq_len=32, out=str(out), resume=str(out))
    Trainer(cfg).run()
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    out = tmp_path / "run"
    train(tiny_config(out, steps=3))
    before = tree_digest(out / "checkpoints" / "step-00000003")
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out), str(marker)])
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert child.poll() is None, "child exited before reaching the save"
            assert time.time() < deadline, "child never reached the save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    root = out / "checkpoints"
    assert [p.name for p in root.glob(".step-*")], "the killed save should have left its temporary directory"
    ckpt = find_checkpoint(out)
    assert ckpt.name == "step-00000003"
    assert tree_digest(ckpt) == before
    t = Trainer(tiny_config(tmp_path / "loader", steps=6))  # a state to load into; a run dir of its own
    state = load_checkpoint(ckpt, t.state)
    assert state.step == 3
    # The next save cleans up what the crash left.
    train(tiny_config(out, steps=6, resume=str(out)))
    assert not list(root.glob(".step-*"))
    assert find_checkpoint(out).name == "step-00000006"


def test_a_flipped_byte_is_detected_on_resume(tmp_path):
    train(tiny_config(tmp_path, steps=2))
    path = find_checkpoint(tmp_path) / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer.safetensors is missing or damaged"):
        Trainer(tiny_config(tmp_path, steps=4, resume=str(tmp_path)))


def test_a_checkpoint_from_another_model_is_refused_and_left_intact(tmp_path):
    train(tiny_config(tmp_path, steps=2))
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointError, match="different model .*n_layer: checkpoint 2 vs this run 3"):
        Trainer(tiny_config(tmp_path, steps=4, resume=str(tmp_path),
                            model={**__import__("tiertrain").models.CONFIGS["tiny"].to_dict(), "n_layer": 3}))
    assert tree_digest(tmp_path) == before


def test_old_checkpoints_are_pruned_to_keep(tmp_path):
    train(tiny_config(tmp_path, steps=6, save_every=1, keep_checkpoints=2))
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000005", "step-00000006"]


def test_no_save_writes_no_checkpoint_and_refuses_save_every(tmp_path):
    summary = train(tiny_config(tmp_path, steps=2, save=False))
    assert summary.steps == 2 and summary.checkpoint is None
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="--no-save writes no checkpoint and --save-every 2"):
        tiny_config(tmp_path, steps=4, save=False, save_every=2)


def test_no_save_on_the_command_line_wins_over_a_resumed_runs_save_every(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--save-every", "1", "--out", str(run), "--quiet"]) == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main(["train", "--resume", str(run), "--steps", "3", "--no-save", "--quiet"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"save": False}))  # the same said in a config file
    assert main(["train", "--resume", str(run), "--steps", "3", "--config", str(cfg), "--quiet"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    capsys.readouterr()


def test_micro_batches_in_a_config_file_is_grad_accum(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"micro_batches": 2, "grad_accum": 4}))
    assert main(["train", "--config", str(cfg), "--model", "tiny", "--out", str(tmp_path / "r")]) == 2
    assert "micro_batches 2 and grad_accum 4 name the same count" in capsys.readouterr().err
    cfg.write_text(json.dumps({"micro_batches": 2}))
    assert main(["train", "--config", str(cfg), "--model", "tiny", "--steps", "1", "--batch-size", "2",
                 "--seq-len", "16", "--out", str(tmp_path / "r2"), "--quiet"]) == 0
    assert json.loads((tmp_path / "r2" / "metrics.jsonl").read_text().splitlines()[0])["tokens_per_s"] > 0
    trainer = json.loads(next((tmp_path / "r2" / "checkpoints").glob("step-*/trainer.json")).read_text())
    assert trainer["run_config"]["grad_accum"] == 2
    cfg.write_text(json.dumps({"micro_batches": 4}))  # over the resumed run's grad_accum 2: the file's word wins
    assert main(["train", "--resume", str(tmp_path / "r2"), "--config", str(cfg), "--steps", "2", "--quiet"]) == 0
    assert json.loads((tmp_path / "r2" / "checkpoints" / "step-00000002" / "trainer.json").read_text())[
        "run_config"]["grad_accum"] == 4


def test_nothing_in_the_package_unpickles():
    src = Path(__file__).resolve().parents[1] / "src"
    for path in src.rglob("*.py"):
        text = path.read_text()
        for banned in ("import pickle", "pickle.load", "allow_pickle=True", "weights_only=False"):
            assert banned not in text, (path, banned)
        assert "torch.load(" not in text or "weights_only=True" in text, path


def test_streamed_safetensors_files_read_back_with_safetensors_itself(tmp_path):
    import crc32c
    import torch
    from safetensors.torch import load_file

    from tiertrain.tensor_file import LazyTensors, TensorSpec, TensorStream, write_streamed

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "half": torch.randn(7, generator=g).to(torch.bfloat16),
               "step": torch.tensor(4.0), "rng": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
               "empty": torch.zeros(0, 4)}
    path = tmp_path / "t.safetensors"
    crc = write_streamed(path, TensorStream.of(tensors), {"format": "pt"})
    assert crc == crc32c.crc32c(path.read_bytes())
    back = load_file(path)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    lazy = LazyTensors(path)
    assert "w" in lazy and "nope" not in lazy and lazy.shape("w") == (3, 5) and len(lazy) == 5
    assert torch.equal(lazy["half"], tensors["half"]) and lazy.get("nope") is None
    # a producer that breaks its announcement is a bug, never a silently wrong file
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (2,))]
    with pytest.raises(RuntimeError, match="b: produced"):
        write_streamed(tmp_path / "bad.safetensors", TensorStream(specs, lambda: iter([torch.ones(2), torch.ones(3)])))
    with pytest.raises(RuntimeError, match="1 tensors produced, 2 announced"):
        write_streamed(tmp_path / "short.safetensors", TensorStream(specs, lambda: iter([torch.ones(2)])))


def test_reading_a_checkpoint_file_keeps_at_most_a_bound_of_its_pages_resident(tmp_path, monkeypatch):
    """safetensors maps the file, and every page a read touches stays in the process's resident set
    until the mapping goes (a 354M resume held 4.1 GB of them beside 2 GB of budgets): ``LazyTensors``
    maps the file afresh every ``REMAP_BYTES`` read, and reads the same values across the remaps."""
    import torch

    from tiertrain import tensor_file
    from tiertrain.tensor_file import LazyTensors, TensorStream, write_streamed

    def file_rss() -> int:
        return int(next(ln for ln in open("/proc/self/status") if ln.startswith("RssFile")).split()[1]) << 10

    monkeypatch.setattr(tensor_file, "REMAP_BYTES", 8 << 20)
    tensors = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(24)}  # 24 x 4 MiB
    path = tmp_path / "big.safetensors"
    write_streamed(path, TensorStream.of(tensors))
    lazy, before, most = LazyTensors(path), file_rss(), 0
    for i in range(24):
        assert torch.equal(lazy[f"t{i}"], tensors[f"t{i}"])
        assert torch.equal(lazy.read_range(f"t{i}", 5, 9), tensors[f"t{i}"][5:9])
        most = max(most, file_rss() - before)
    assert most < 24 << 20, f"{most >> 20} MiB of the file's 96 MiB stayed resident"


def test_a_streamed_file_never_holds_more_than_a_bound_of_unwritten_bytes_in_the_page_cache(tmp_path, monkeypatch):
    """A memory cgroup counts its page cache and cgroup v1 does not throttle dirty pages: the writer
    flushes and drops what it has written every ``DIRTY_BYTES``, so a checkpoint larger than a
    memory cap is never all in the cache at once. The file is the same either way."""
    import torch

    import tiertrain.tensor_file as tensor_file
    from safetensors.torch import load_file

    synced = []
    monkeypatch.setattr(tensor_file, "DIRTY_BYTES", 1 << 20)
    real_sync = tensor_file.os.fdatasync
    monkeypatch.setattr(tensor_file.os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real_sync(fd)))
    tensors = {f"t{i}": torch.full((128, 1024), float(i)) for i in range(10)}  # 512 KiB each, 5 MiB in all
    tensor_file.write_streamed(tmp_path / "big.safetensors", tensor_file.TensorStream.of(tensors))
    assert len(synced) == 5 and all(b - a <= (1 << 20) + (512 << 10) for a, b in zip([0] + synced, synced))
    back = load_file(tmp_path / "big.safetensors")
    assert all(torch.equal(back[k], t) for k, t in tensors.items())


def test_checkpoints_whose_manifest_holds_sha256_digests_still_verify(tmp_path):
    """Manifests recorded sha256 before they recorded CRC-32C; such checkpoints still resume, and
    damage to them is still found."""
    import json

    train(tiny_config(tmp_path, steps=2))
    ckpt = find_checkpoint(tmp_path)
    trainer = json.loads((ckpt / "trainer.json").read_text())
    assert all(d.startswith("crc32c:") for d in trainer["files"].values())
    trainer["files"] = {name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest() for name in trainer["files"]}
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    state = Trainer(tiny_config(tmp_path / "loader", steps=4)).state  # a run dir of its own: tmp_path holds a run
    assert load_checkpoint(ckpt, state).step == 2
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is missing or damaged"):
        load_checkpoint(ckpt, state)


def test_states_set_up_for_a_resume_are_written_once_by_the_checkpoint_and_never_drawn(tmp_path, monkeypatch):
    """Resuming sets up the tiers without the model's weights (``init_states=False``): a meta-built
    model is not initialised and disk-homed states are not written, so the checkpoint writes them,
    once. Until it has, a disk state cannot be read (its pages were never written), so nothing
    trains on bytes no one wrote. After loading, training goes on exactly as the run that saved it."""
    import torch

    import tiertrain
    import tiertrain.runtime.build as block_state
    from tiertrain.errors import DiskError
    from tiertrain.memory import Budgets, Tier
    from tiertrain.models import ModelConfig, build
    from tiertrain.runtime.state_io import export_state, import_state

    cfg = ModelConfig(n_layer=3, n_head=4, d_model=64, d_ffn=256, vocab_size=256, max_seq_len=64, name="t")
    budgets = Budgets(16 << 20, 64 << 20, 64 << 20, str(tmp_path / "disk"))
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))

    def run(init: bool):
        model = build(cfg, device="meta")
        tm, topt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), budgets, plan="max-offload",
                                   page_size=64 << 10, init_states=init)
        return tm, topt

    def step(tm, topt) -> float:
        loss = torch.nn.functional.cross_entropy(tm(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        topt.step()
        topt.zero_grad()
        return loss.item()

    saved, saved_opt = run(True)
    step(saved, saved_opt)
    weights, optim = export_state(saved.runtime)
    want = [step(saved, saved_opt) for _ in range(2)]
    drawn = []
    monkeypatch.setattr(block_state, "init_in_place", lambda *a: drawn.append(a))
    fresh, fresh_opt = run(False)
    assert not drawn
    on_disk = [c for st in fresh.runtime.groups for c in (st.master, st.exp_avg, st.exp_avg_sq) if c.tier is Tier.DISK]
    assert len(on_disk) == 3 * len(fresh.runtime.groups)
    for chunk in on_disk:
        with pytest.raises(DiskError, match="never written"):
            fresh.runtime.mem.to_tensor(chunk)
    import_state(fresh.runtime, weights, optim)
    assert [step(fresh, fresh_opt) for _ in range(2)] == want
    for tm in (saved, fresh):
        tm.runtime.close()
        tm.runtime.mem.close()


def test_streaming_a_checkpoint_gives_each_blocks_freed_buffers_back_to_the_os(tmp_path, monkeypatch):
    """glibc keeps freed buffers of tens of MB in its heap: a checkpoint streamed block by block
    returns the heap's free memory after each block, out and in (``memory.heap``; on the cgroup
    test's model the first run's peak RSS fell from 1000 MB to 768 MB under an 896 MiB cap)."""
    import torch

    import tiertrain
    import tiertrain.runtime.state_io as state_io
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig, build

    calls = []
    monkeypatch.setattr(state_io, "release_free_heap", lambda: calls.append(1))
    model = build(ModelConfig(n_layer=3, n_head=4, d_model=64, d_ffn=256, vocab_size=256, max_seq_len=64, name="t"))
    tm, topt = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               Budgets(16 << 20, 64 << 20, 64 << 20, str(tmp_path / "disk")), plan="max-offload",
                               page_size=64 << 10)
    try:
        x = torch.randint(0, 256, (2, 17))
        tm(x[:, :-1], x[:, 1:]).backward()
        topt.step()
        weights, optim = state_io.export_state(tm.runtime)
        blocks = len(tm.runtime.groups)
        assert len(calls) == 2 * blocks  # the weights' stream and the moments' stream
        state_io.import_state(tm.runtime, weights, optim)
        assert len(calls) == 3 * blocks
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


# ---------------------------------------------------------------- issue 16: pruning, confinement, bad insides, full disks

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """One tiny run with one checkpoint (step 2), trained once for the tests below; each works on a copy."""
    out = tmp_path_factory.mktemp("saved") / "run"
    train(tiny_config(out, steps=2))
    return out


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    """A tiny model's training state to load checkpoints into (in a run directory of its own)."""
    return Trainer(tiny_config(tmp_path_factory.mktemp("loader") / "out", steps=4)).state


@pytest.fixture
def run(saved_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out, symlinks=True)
    return out


def ckpt_of(run: Path) -> Path:
    return run / "checkpoints" / "step-00000002"


def names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step-*"))


def edit_trainer(ckpt: Path, edit) -> None:
    """Apply ``edit`` to trainer.json (it may change the mapping in place or return a new value)."""
    data = json.loads((ckpt / "trainer.json").read_text())
    new = edit(data)
    (ckpt / "trainer.json").write_text(json.dumps(data if new is None else new))


def refresh_digest(ckpt: Path, name: str) -> None:
    """Record the file's current checksum, so that only the check under test can refuse it."""
    edit_trainer(ckpt, lambda d: d["files"].__setitem__(name, file_digest(ckpt / name)))


def assert_refused(call, *phrases: str) -> str:
    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for phrase in phrases:
        assert phrase in message, message
    return message


def at(step: int) -> TrainerState:
    return TrainerState(step=step, data_position=step, scaler={}, run_config={})


def test_a_second_run_writing_lower_steps_keeps_its_own_checkpoints(tmp_path, loader):
    """Issue 16.1: pruning kept the highest step numbers, so a new run into a directory holding a
    longer run's checkpoints deleted its own, and ``latest`` named a deleted one."""
    out = tmp_path / "run"
    for step in (5, 10):  # an earlier, longer run
        save_checkpoint(out, loader, at(step), keep=2)
    for step in (2, 4):  # a new run into the same directory
        written = save_checkpoint(out, loader, at(step), keep=2)
        assert written.is_dir()
    assert names(out) == ["step-00000002", "step-00000004"]
    assert find_checkpoint(out).name == "step-00000004"


def test_resuming_from_an_earlier_checkpoint_keeps_what_it_writes(tmp_path, loader):
    out = tmp_path / "run"
    train(tiny_config(out, steps=10, save_every=2, keep_checkpoints=5))
    summary = train(tiny_config(out, steps=4, keep_checkpoints=2, resume=str(out / "checkpoints" / "step-00000002")))
    assert summary.checkpoint == out / "checkpoints" / "step-00000004" and summary.checkpoint.is_dir()
    assert find_checkpoint(out) == summary.checkpoint
    assert names(out) == ["step-00000004", "step-00000010"]  # the one written, and the most recent of the others
    assert load_checkpoint(summary.checkpoint, loader).step == 4


def test_checkpoints_without_a_write_stamp_count_as_older_ordered_by_step(tmp_path, loader):
    out = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(out, loader, at(step), keep=10)
    for step in (2, 3):  # as an older tiertrain wrote them
        edit_trainer(out / "checkpoints" / f"step-{step:08d}", lambda d: d.pop("saved_at_ns") and None)
    save_checkpoint(out, loader, at(7), keep=3)
    assert names(out) == ["step-00000001", "step-00000003", "step-00000007"]


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path, loader, monkeypatch):
    import tiertrain.checkpoint.run as ck

    out = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(out, loader, at(step), keep=2)
    monkeypatch.setattr(ck, "write_stamp", lambda: 1)  # a clock set back: the new one looks the oldest
    written = save_checkpoint(out, loader, at(3), keep=2)
    assert written.is_dir() and find_checkpoint(out) == written
    assert names(out) == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("name", ["../../../outside/secret.txt", "ABSOLUTE", "sub/secret.txt", "..", ".", "",
                                  "model.safetensors/", ".hidden", "a\nb"])
def test_manifest_names_never_lead_outside_the_checkpoint(run, loader, tmp_path, name):
    """Issue 16.3: a manifest entry such as ../../../../etc/passwd or an absolute path was opened and read."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    secret = outside / "secret.txt"
    secret.write_bytes(b"not the checkpoint's")
    (outside / "sub" / "secret.txt").write_bytes(b"nor this")
    (ckpt_of(run) / "sub").symlink_to(outside / "sub")
    name = str(secret) if name == "ABSOLUTE" else name
    edit_trainer(ckpt_of(run), lambda d: d["files"].__setitem__(name, file_digest(secret)))  # it would even verify
    before = tree_digest(outside)
    assert_refused(lambda: saved_run_options(run), "not a plain file name")
    assert_refused(lambda: load_checkpoint(ckpt_of(run), loader), "not a plain file name")
    assert tree_digest(outside) == before


def test_a_checkpoint_file_that_is_a_symlink_is_never_followed(run, loader, tmp_path):
    ckpt = ckpt_of(run)
    real = tmp_path / "elsewhere.safetensors"
    shutil.move(ckpt / "model.safetensors", real)
    (ckpt / "model.safetensors").symlink_to(real)  # the same bytes: its checksum matches
    assert_refused(lambda: load_checkpoint(ckpt, loader), "model.safetensors", "symbolic link")


@pytest.mark.parametrize("name", NEEDED)
def test_every_file_the_loader_reads_is_listed_and_verified_before_it_is_read(run, loader, name):
    """config.json (and any file left out of the manifest) was read without being verified."""
    ckpt = ckpt_of(run)
    edit_trainer(ckpt, lambda d: d["files"].pop(name) and None)
    if name == "config.json":
        (ckpt / name).write_text(json.dumps({"tiertrain_model": "x"}))
    else:
        data = bytearray((ckpt / name).read_bytes())
        data[-1] ^= 0xFF
        (ckpt / name).write_bytes(bytes(data))
    assert_refused(lambda: load_checkpoint(ckpt, loader), f"no checksum for {name}")


@pytest.mark.parametrize("how", ["relative", "absolute", "symlinked sibling", "latest a symlink", "not a step"])
def test_latest_names_only_a_checkpoint_directory_beside_it(run, tmp_path, how):
    """Issue 16.3: ``latest`` set to ../../../elsewhere/step-x resumed from outside the run."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run, elsewhere)  # a complete, valid checkpoint outside the run
    target = elsewhere / "checkpoints" / "step-00000002"
    latest = run / "checkpoints" / "latest"
    if how == "relative":
        latest.write_text("../../elsewhere/checkpoints/step-00000002")
    elif how == "absolute":
        latest.write_text(str(target))
    elif how == "symlinked sibling":
        (run / "checkpoints" / "step-00000099").symlink_to(target)
        latest.write_text("step-00000099")
    elif how == "latest a symlink":
        latest.unlink()
        latest.symlink_to(elsewhere / "checkpoints" / "latest")
    else:
        latest.write_text("step-00000002/..")
    assert_refused(lambda: find_checkpoint(run), str(latest))
    assert_refused(lambda: saved_run_options(run), str(latest))


def test_run_options_naming_places_are_never_taken_from_a_checkpoint(run, tmp_path, capsys):
    """Issue 16.3: trainer.json's run_config.disk made a resume remove a tiertrain-run-* directory
    elsewhere and reserve space there; out, resume and overwrite are no better."""
    victim = tmp_path / "victim"
    (victim / "tiertrain-run-1234").mkdir(parents=True)
    (victim / "tiertrain-run-1234" / "data").write_bytes(b"user data")
    edit_trainer(ckpt_of(run), lambda d: d["run_config"].update(
        out=str(victim), resume=str(victim), disk=f"{victim}:3GiB", overwrite=True))
    options = saved_run_options(run)
    assert not {"out", "resume", "disk", "overwrite"} & set(options) and options["model"] == "tiny"
    before = tree_digest(victim)
    assert main(["train", "--resume", str(run), "--steps", "3", "--quiet"]) == 0, capsys.readouterr().err
    assert tree_digest(victim) == before and sorted(p.name for p in victim.rglob("*")) == ["data", "tiertrain-run-1234"]
    assert find_checkpoint(run).name == "step-00000003"


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


BAD_TRAINER = {
    "a list": lambda d: [d],
    "a number": lambda d: 3,
    "no files": lambda d: d.pop("files") and None,
    "step abc": _set("step", "abc"),
    "step true": _set("step", True),
    "step fractional": _set("step", 2.5),
    "negative data_position": _set("data_position", -1),
    "run_config a list": _set("run_config", ["tiny"]),
    "rng a list": _set("rng", [1, 2]),
    "python rng short": lambda d: d["rng"]["python"].__setitem__(1, d["rng"]["python"][1][:10]),
    "python rng version": lambda d: d["rng"]["python"].__setitem__(0, 2),
    "python rng word": lambda d: d["rng"]["python"][1].__setitem__(0, 2**40),
    "numpy rng position": lambda d: d["rng"]["numpy"].__setitem__(2, 700),
    "numpy rng kind": lambda d: d["rng"]["numpy"].__setitem__(0, "PCG64"),
    "param_groups a mapping": _set("param_groups", {"lr": 1e-3}),
    "param_groups one more": lambda d: d["param_groups"].append(d["param_groups"][0]),
    "param_groups lr a string": lambda d: d["param_groups"][0].__setitem__("lr", "fast"),
    "param_groups betas short": lambda d: d["param_groups"][0].__setitem__("betas", [0.9]),
    "param_groups eps negative": lambda d: d["param_groups"][1].__setitem__("eps", -1),
    "param_groups group a list": lambda d: d["param_groups"].__setitem__(0, [1]),
    "scaler a list": _set("scaler", [1]),
    "scaler scale a string": _set("scaler", {"scale": "big", "growth_factor": 2.0, "backoff_factor": 0.5,
                                             "growth_interval": 2000, "_growth_tracker": 0}),
    "scaler incomplete": _set("scaler", {"scale": 1024.0}),
    "format_version": _set("format_version", 2),
    "files a list": _set("files", ["model.safetensors"]),
    "digest a number": lambda d: d["files"].__setitem__("model.safetensors", 5),
    "unknown field": _set("bogus", 1),
    "saved_at_ns negative": _set("saved_at_ns", -5),
}


@pytest.mark.parametrize("case", BAD_TRAINER)
def test_trainer_json_wrong_inside_is_one_checkpoint_error(run, loader, case):
    """Issue 16.5: valid JSON but wrong inside ended in a traceback (or was taken as it was)."""
    ckpt = ckpt_of(run)
    edit_trainer(ckpt, BAD_TRAINER[case])
    before, rng = tree_digest(run), torch.get_rng_state()
    assert_refused(lambda: load_checkpoint(ckpt, loader))
    assert tree_digest(run) == before and torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("bad", ["float32", "short", "unknown key", "missing"])
def test_torch_rng_states_must_be_uint8_states_of_the_right_size(run, loader, bad):
    """Issue 16.5: an rng.safetensors holding float32 ended in a traceback."""
    ckpt = ckpt_of(run)
    rng = load_file(ckpt / "rng.safetensors")
    if bad == "float32":
        rng["torch_cpu"] = rng["torch_cpu"].float()
    elif bad == "short":
        rng["torch_cpu"] = rng["torch_cpu"][:100].clone()
    elif bad == "unknown key":
        rng["numpy"] = torch.zeros(3, dtype=torch.uint8)
    else:
        rng = {"torch_cuda_0": rng["torch_cpu"]}
    save_file(rng, ckpt / "rng.safetensors")
    refresh_digest(ckpt, "rng.safetensors")
    before = torch.get_rng_state()
    assert_refused(lambda: load_checkpoint(ckpt, loader), "rng.safetensors")
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("bad", ["float16 moment", "transposed moment", "missing step", "unknown kind",
                                 "step a vector"])
def test_optimizer_state_must_fit_the_models_parameters(run, loader, bad):
    ckpt = ckpt_of(run)
    opt = load_file(ckpt / "optimizer.safetensors")
    key = "blocks.0.attn.qkv.weight"  # 96 x 32
    if bad == "float16 moment":
        opt[f"{key}::exp_avg"] = opt[f"{key}::exp_avg"].half()
    elif bad == "transposed moment":
        opt[f"{key}::exp_avg"] = opt[f"{key}::exp_avg"].t().contiguous()
    elif bad == "missing step":
        del opt[f"{key}::step"]
    elif bad == "unknown kind":
        opt[f"{key}::momentum"] = opt[f"{key}::exp_avg"]
    else:
        opt[f"{key}::step"] = torch.ones(3)
    save_file({k: v.clone() for k, v in opt.items()}, ckpt / "optimizer.safetensors")
    refresh_digest(ckpt, "optimizer.safetensors")
    assert_refused(lambda: load_checkpoint(ckpt, loader), "optimizer")


@pytest.mark.parametrize("config", [[], "tiny", {"tiertrain_model": ["tiny"]}])
def test_config_json_that_describes_no_model_is_refused(run, loader, config):
    ckpt = ckpt_of(run)
    (ckpt / "config.json").write_text(json.dumps(config))
    refresh_digest(ckpt, "config.json")
    assert_refused(lambda: load_checkpoint(ckpt, loader), "config.json")


def test_a_save_that_fails_removes_its_temporary_directory_and_keeps_the_last(run, monkeypatch):
    """Issue 16.5: ENOSPC during a save was a traceback and left a hidden temporary directory."""
    import tiertrain.checkpoint.run as ck

    root = run / "checkpoints"
    before = tree_digest(root)
    real = ck.write_streamed

    def full_disk(path, stream, metadata=None):
        if path.name == "optimizer.safetensors":
            path.write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, stream, metadata)

    monkeypatch.setattr(ck, "write_streamed", full_disk)
    with pytest.raises(OutputError) as info:
        train(tiny_config(run, steps=4, resume=str(run)))
    message = str(info.value)
    assert "\n" not in message and str(root) in message and "No space left on device" in message
    assert "free there" in message and "choose another --out" in message
    assert not list(root.glob(".*")) and tree_digest(root) == before


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs mounted for the test (root only), unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                              text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_out_of_space_during_a_save_is_one_error_line_and_loses_nothing(small_tmpfs, loader, capsys):
    """Issue 16, must hold: ENOSPC during a save on a small tmpfs: the previous checkpoint intact,
    ``latest`` unchanged, no temporary directory left, exit 2 with one ``error:`` line."""
    out = small_tmpfs / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
    root = out / "checkpoints"
    before = tree_digest(root)
    with open(small_tmpfs / "filler", "wb") as f:  # leave room for metrics rows, not for a checkpoint
        while shutil.disk_usage(small_tmpfs).free > 96 << 10:
            f.write(b"\xff" * min(1 << 20, shutil.disk_usage(small_tmpfs).free - (96 << 10) + 4096))
            f.flush()
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "4", "--quiet"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot save checkpoint step-00000004"), lines
    assert "No space left on device" in lines[0] and str(root) in lines[0] and "free there" in lines[0]
    assert tree_digest(root) == before and not list(root.glob(".*")) and names(out) == ["step-00000002"]
    assert load_checkpoint(find_checkpoint(out), loader).step == 2


def test_a_checkpoint_of_disk_homed_states_reads_one_parameter_at_a_time(tmp_path, monkeypatch):
    """Saving streams the masters and both moments from disk a parameter at a time: no read takes a
    whole block's chunk, and when one parameter's state reaches the writer, no other read's buffer is
    still alive (both moments of a block read whole raised a 354M run's RSS by 230 MB while it saved)."""
    import weakref

    import tiertrain
    from tiered_harness import TINY4, _fresh, _loop
    from tiertrain.memory import Budgets, system
    from tiertrain.plan import builtin_plan
    import torch
    from safetensors.torch import load_file

    from tiertrain.runtime import state_io
    from tiertrain.runtime.state_io import export_state, optimizer_stream, weight_stream
    from tiertrain.tensor_file import write_streamed

    wide = {**TINY4, "n_layer": 2, "d_model": 128, "d_ffn": 512}  # a block's chunk: 3x its largest parameter
    model, opt = _fresh(wide)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path)),
                               plan=builtin_plan("max-offload", 2, disk=True), page_size=64 << 10)
    rt = tm.runtime
    try:
        _loop(tm, topt, None, 1, 1, None)
        buffers, real_buffer, real_whole = [], system.host_buffer, rt.mem.to_tensor

        def host_buffer(nbytes, pin):  # a read's aligned buffer: alive while any view of it is
            out, region = real_buffer(nbytes, pin)
            buffers.append((weakref.ref(region), nbytes))
            return out, region

        def to_tensor(chunk):  # a whole chunk read at once
            out = real_whole(chunk)
            buffers.append((lambda: None, out.numel() * out.element_size()))
            return out

        monkeypatch.setattr(system, "host_buffer", host_buffer)
        rt.mem.to_tensor = to_tensor
        largest = max(p.numel() for p in tm.parameters()) * 4 + 2 * (64 << 10)  # its pages, at most two more
        yielded = 0
        for stream in (weight_stream(rt), optimizer_stream(rt)):
            for t in stream.tensors():  # each buffer freed by its count once dropped (no gc pass: 200 took 20 s)
                assert sum(r() is not None for r, _ in buffers) <= 1, "another read is held beside this one"
                yielded += 1
                del t
        assert yielded > 3 * len(list(tm.parameters())) and buffers
        assert max(n for _, n in buffers) <= largest
        # the writer takes each parameter in pieces (one 1.7B embedding's state is 463 MB): the files hold
        # exactly what the whole tensors hold, and no read is larger than a piece's pages
        want = export_state(rt)
        buffers.clear()
        monkeypatch.setattr(state_io, "PIECE_BYTES", 16 << 10)
        for name, stream, expect in (("w", weight_stream(rt), want[0]), ("o", optimizer_stream(rt), want[1])):
            write_streamed(tmp_path / f"{name}.safetensors", stream)
            back = load_file(tmp_path / f"{name}.safetensors")
            assert back.keys() == expect.keys() and all(torch.equal(back[k], expect[k]) for k in expect)
        assert buffers and max(n for _, n in buffers) <= (16 << 10) + 2 * (64 << 10) < largest // 2
    finally:
        rt.close()
        rt.mem.close()
