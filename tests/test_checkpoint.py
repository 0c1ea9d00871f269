import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from tiertrain.engine.checkpoint import find_checkpoint, load_checkpoint
from tiertrain.engine.loop import Trainer, train
from tiertrain.errors import CheckpointError


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import safetensors.torch
    import tiertrain.engine.checkpoint as ck
    from tiertrain.engine.config import TrainConfig
    from tiertrain.engine.loop import Trainer

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
    t = Trainer(tiny_config(out, steps=6))
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
    assert load_checkpoint(ckpt, Trainer(tiny_config(tmp_path, steps=4)).state).step == 2
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is missing or damaged"):
        load_checkpoint(ckpt, Trainer(tiny_config(tmp_path, steps=4)).state)


def test_states_set_up_for_a_resume_are_written_once_by_the_checkpoint_and_never_drawn(tmp_path, monkeypatch):
    """Resuming sets up the tiers without the model's weights (``init_states=False``): a meta-built
    model is not initialised and disk-homed states are not written, so the checkpoint writes them,
    once. Until it has, a disk state cannot be read (its pages were never written), so nothing
    trains on bytes no one wrote. After loading, training goes on exactly as the run that saved it."""
    import torch

    import tiertrain
    import tiertrain.runtime.block_state as block_state
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
    on_disk = [c for st in fresh.runtime.states for c in (st.master, st.exp_avg, st.exp_avg_sq) if c.tier is Tier.DISK]
    assert len(on_disk) == 3 * len(fresh.runtime.states)
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
        blocks = len(tm.runtime.states)
        assert len(calls) == 2 * blocks  # the weights' stream and the moments' stream
        state_io.import_state(tm.runtime, weights, optim)
        assert len(calls) == 3 * blocks
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
