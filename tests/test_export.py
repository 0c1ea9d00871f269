"""``tiertrain export`` (issue 37): a checkpoint, sharded over ranks or not, as one safetensors state dict
with its config; for a transformers model a directory ``from_pretrained`` loads, with the run's logits."""

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from tiertrain.checkpoint import export
from tiertrain.cli.main import main
from tiertrain.train.loop import Trainer

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}


def _runs_logits(tmp: Path, run: Path, model: str, ids: torch.Tensor) -> torch.Tensor:
    """The run's model, as its checkpoint resumes in one process (a resume is the run's state: tested
    against the uninterrupted run's losses), on ``ids``."""
    trainer = Trainer(tiny_config(tmp / "resumed", model=model, resume=str(run), steps=3, plan="stream"))
    try:
        with torch.no_grad():
            out = trainer.model(ids)
        return out.logits if hasattr(out, "logits") else out
    finally:
        trainer.close()


def test_a_two_rank_checkpoint_of_a_transformers_model_exports_to_what_from_pretrained_loads_with_the_runs_logits(
        tmp_path, monkeypatch, capsys):
    """Each parameter is cut out of the rank files it spans and written a piece at a time (pieces of
    100 bytes here: a parameter spans many, and the shards' boundaries fall inside them); the logits of
    the exported model equal the run's bit for bit, and a bf16 export holds the same weights rounded."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2))
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tiertrain", "train", "--model", str(tmp_path / "gpt2.json"), "--plan",
                        "stream", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--out", str(run),
                        "--nproc", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    monkeypatch.setattr(export, "PIECE_BYTES", 100)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "exporting 28 tensors" in said and "from " + str(run / "checkpoints" / "step-00000002") in said
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, _runs_logits(tmp_path, run, str(tmp_path / "gpt2.json"), ids))
    assert main(["export", str(run), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    full, half = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert full.keys() == half.keys() and all(torch.equal(full[k].to(torch.bfloat16), half[k]) for k in full)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_one_process_checkpoint_of_tiertrains_model_exports_to_a_state_dict_build_loads(tmp_path, monkeypatch):
    from tiertrain.models import build

    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--plan", "stream", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--out", str(run)]) == 0
    monkeypatch.setattr(export, "PIECE_BYTES", 100)  # a few rows at a time
    assert main(["export", str(run / "checkpoints" / "step-00000002"), "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    model = build(config["tiertrain_model"])
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=False)
    assert not unexpected and all(_tied(model, name) for name in missing)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), _runs_logits(tmp_path, run, "tiny", ids))


def _tied(model: torch.nn.Module, name: str) -> bool:
    """Whether the parameter ``name`` shares its storage with another (a tied head): saved once."""
    p = dict(model.named_parameters(remove_duplicate=False))[name]
    return any(q is p and n != name for n, q in model.named_parameters(remove_duplicate=False))


def test_export_refuses_a_non_empty_directory_and_a_damaged_shard_with_one_line_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--plan", "stream", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--out", str(run)]) == 0
    capsys.readouterr()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    assert main(["export", str(run), "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "exists and is not an empty directory" in err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    weights = run / "checkpoints" / "step-00000001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "missing or damaged (checksum mismatch)" in err, err
    assert not (tmp_path / "out").exists()


def test_an_export_that_fails_partway_leaves_no_directory_and_says_why(tmp_path, monkeypatch, capsys):
    """A full disk while the weights are written: one line naming it, and neither the directory export
    made nor its temporary one is left."""
    run = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--plan", "stream", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--out", str(run)]) == 0
    real = export._write

    def full(tmp, *args):
        real(tmp, *args)  # the weights written, then the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "_write", full)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"the disk under {tmp_path} is full" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
