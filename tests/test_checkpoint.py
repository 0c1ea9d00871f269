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
