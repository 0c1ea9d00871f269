import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics, tiny_config
from tiertrain.train.config import TrainConfig
from tiertrain.train.loop import Trainer, train
from tiertrain.train.schedule import lr_at
from tiertrain.errors import ConfigError
from tiertrain.models import GPT, CONFIGS


def test_loss_falls_on_the_builtin_corpus(tmp_path):
    s = train(tiny_config(tmp_path, steps=60, batch_size=8, seq_len=64, lr=1e-2))
    early, late = np.mean(s.losses[:5]), np.mean(s.losses[-5:])
    assert early > 5.0 and late < early - 1.5, (early, late)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 61))
    for key in ("loss", "tokens_per_s", "tflops", "peak_bytes", "lr", "grad_norm"):
        assert key in rows[0]
    assert rows[0]["tflops"] > 0 and rows[0]["peak_bytes"]["host"] > 0


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 1.0, 0.1, 10, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_same_seed_same_losses_and_other_seed_differs(tmp_path):
    a = train(tiny_config(tmp_path / "a", steps=3)).losses
    b = train(tiny_config(tmp_path / "b", steps=3)).losses
    c = train(tiny_config(tmp_path / "c", steps=3, seed=1)).losses
    assert a == b and a != c


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", "tiny-bert"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, model):
    kw = dict(model=model, steps=8, grad_accum=2, grad_clip=0.5, save_every=4, keep_checkpoints=5)
    full = train(tiny_config(tmp_path / "full", **kw))
    mid = tmp_path / "full" / "checkpoints" / "step-00000004"
    resumed = train(tiny_config(tmp_path / "resumed", resume=str(mid), **kw))
    assert resumed.losses == full.losses[4:]
    a = load_file(tmp_path / "full/checkpoints/step-00000008/model.safetensors")
    b = load_file(tmp_path / "resumed/checkpoints/step-00000008/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_into_the_same_run_keeps_one_metrics_row_per_step(tmp_path):
    train(tiny_config(tmp_path, steps=8, save_every=3, keep_checkpoints=5))
    train(tiny_config(tmp_path, steps=8, resume=str(tmp_path / "checkpoints" / "step-00000003")))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))


def test_resume_with_nothing_left_to_do_says_so(tmp_path):
    train(tiny_config(tmp_path, steps=3))
    with pytest.raises(ConfigError, match="already at step 3"):
        Trainer(tiny_config(tmp_path, steps=3, resume=str(tmp_path)))


def test_a_resume_that_moves_the_lr_schedule_says_so_and_how_to_keep_it(tmp_path):
    """The schedule is a function of --steps (and the lr options): resuming a 4-step run to train on to
    8 stretches its cosine, so step 5's lr is not the one the run's own schedule had; the run says
    both figures and the flags that would keep it. The same --steps resumes without a word."""
    import io

    from tiertrain.train.metrics import Reporter

    def resumed(**kw) -> str:
        text = io.StringIO()
        cfg = tiny_config(tmp_path, resume=str(tmp_path / "checkpoints" / "step-00000004"), **kw)
        with Trainer(cfg, Reporter(cfg.steps, 1, stream=text)):
            return text.getvalue()

    train(tiny_config(tmp_path, steps=8, save_every=4, keep_checkpoints=5))  # warm-up 0 steps at 8 (8 // 10)
    assert "schedule" not in resumed(steps=8)
    cfg = tiny_config(tmp_path, steps=16)
    was, now = lr_at(4, cfg.lr, cfg.final_lr, 0, 8), lr_at(4, cfg.lr, cfg.final_lr, cfg.warmup, 16)
    said = resumed(steps=16)
    assert (f"the learning-rate schedule moved (--steps 8 -> 16): step 5 runs at lr {now:.3g} where the run's own "
            f"schedule had {was:.3g}; resume with --steps 8 to keep it") in said, said
    assert "--lr 0.003 -> 0.001" in resumed(steps=8, lr=1e-3)


def test_a_finished_runs_hint_to_keep_its_lr_is_a_command_that_works(tmp_path):
    """A run that finished its schedule, resumed to train on: its own --steps would leave nothing to do,
    so the hint names the flags that go on at the lr it ended with; given, they move nothing, and the
    command line has each of them."""
    import io
    import re

    from conftest import run_cli
    from tiertrain.train.metrics import Reporter

    def resumed(**kw) -> str:
        text = io.StringIO()
        cfg = tiny_config(tmp_path, resume=str(tmp_path), **kw)
        with Trainer(cfg, Reporter(cfg.steps, 1, stream=text)):
            return text.getvalue()

    train(tiny_config(tmp_path, steps=4))
    said = resumed(steps=8)
    hint = re.search(r"resume with --lr (\S+) --min-lr (\S+) --warmup-steps 0 to go on at the lr it ended with", said)
    assert hint, said
    lr, floor = float(hint.group(1)), float(hint.group(2))
    assert lr == floor == pytest.approx(tiny_config(tmp_path).final_lr, rel=1e-6)  # where the cosine ended
    assert "schedule" not in resumed(steps=8, lr=lr, min_lr=floor, warmup_steps=0)
    r = run_cli("train", "--resume", str(tmp_path), "--steps", "5", "--lr", hint.group(1), "--min-lr", hint.group(2),
                "--warmup-steps", "0")
    assert r.returncode == 0 and "resumed from" in r.stdout and "schedule" not in r.stdout + r.stderr, r.stderr
    assert read_metrics(tmp_path)[-1]["lr"] == pytest.approx(lr, rel=1e-6)


def test_a_closed_output_stops_the_run_as_sigterm_does_with_a_checkpoint_and_one_line(tmp_path):
    """``tiertrain train ... | head -2``: once the reader is gone the run finishes its step, saves and says
    so on stderr (a write to the closed pipe had ended it with exit 1, no message and no checkpoint)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "tiertrain.cli.main", "train", "--model", "tiny", "--steps", "400",
                          "--log-every", "1", "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().startswith("training tiny") and p.stdout.readline().startswith("step")
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0, err
    stopped = int((tmp_path / "checkpoints" / "latest").read_text().split("-")[1])
    assert 1 <= stopped < 400 and len(read_metrics(tmp_path)) == stopped
    line = (f"tiertrain: the output was closed (its reader went away) at step {stopped}; stopped as on SIGTERM, "
            f"checkpoint {tmp_path / 'checkpoints' / f'step-{stopped:08d}'}; resume with tiertrain train --resume {tmp_path}")
    assert err.strip().splitlines() == [line], err
    train(tiny_config(tmp_path, model="tiny", steps=stopped + 1, resume=str(tmp_path)))
    assert [r["step"] for r in read_metrics(tmp_path)][-1] == stopped + 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_fp16_resumes_its_loss_scale(tmp_path, precision):
    kw = dict(steps=6, precision=precision, save_every=3, keep_checkpoints=5, lr=1e-2)
    full = train(tiny_config(tmp_path / "a", **kw))
    assert all(np.isfinite(full.losses)) and full.losses[-1] < full.losses[0]
    resumed = train(tiny_config(tmp_path / "b", resume=str(tmp_path / "a/checkpoints/step-00000003"), **kw))
    assert resumed.losses == full.losses[3:]
    if precision == "fp16":
        assert "loss_scale" in read_metrics(tmp_path / "a")[0]
        saved = json.loads((tmp_path / "a/checkpoints/step-00000003/trainer.json").read_text())
        assert saved["scaler"]["scale"] > 0


def test_weights_load_in_plain_pytorch(tmp_path):
    train(tiny_config(tmp_path, steps=2))
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    cfg = json.loads((ckpt / "config.json").read_text())["tiertrain_model"]
    assert cfg == CONFIGS["tiny"].to_dict()
    model = GPT(CONFIGS["tiny"])
    missing, unexpected = model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to tok_emb.weight, stored once
    assert torch.equal(model.lm_head.weight, load_file(ckpt / "model.safetensors")["tok_emb.weight"])


HF_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256}


def test_a_transformers_model_trains_unchanged_and_reloads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    s = train(tiny_config(tmp_path, model=HF_GPT2, steps=40, batch_size=8, lr=1e-2))
    assert np.mean(s.losses[-5:]) < np.mean(s.losses[:5]) - 1.0
    ckpt = tmp_path / "checkpoints" / "step-00000040"
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    saved = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_the_default_sequence_length_is_shortened_to_what_the_model_takes(tmp_path):
    """No --seq-len: 128 tokens, or the model's maximum where shorter (tiny takes 64), kept for a
    resume; one given that the model cannot take is refused, as before."""
    trainer = Trainer(TrainConfig(model="tiny", steps=1, batch_size=2, out=str(tmp_path / "run")))
    assert trainer.cfg.seq_len == CONFIGS["tiny"].max_seq_len == 64
    trainer.run()
    assert json.loads((tmp_path / "run" / "checkpoints" / "step-00000001" / "trainer.json").read_text()
                      )["run_config"]["seq_len"] == 64
    with Trainer(TrainConfig(model="gpt-small", steps=1, out=str(tmp_path / "small"))) as small:
        assert small.cfg.seq_len == 128
    with pytest.raises(ConfigError, match="--seq-len 65 exceeds the model's maximum 64"):
        Trainer(TrainConfig(model="tiny", seq_len=65, out=str(tmp_path / "long")))


def test_config_file_and_flags_merge_with_flags_winning(tmp_path):
    from tiertrain.train.config import make_config

    cfg = make_config({"steps": 5, "batch-size": 3, "betas": [0.8, 0.9]}, {"steps": 7, "lr": None})
    assert (cfg.steps, cfg.batch_size, cfg.betas, cfg.lr) == (7, 3, (0.8, 0.9), TrainConfig().lr)
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        make_config({"step": 5}, {})
    for theirs, ours in (("learning_rate", "lr"), ("gradient_accumulation_steps", "grad_accum"), ("block_size", "seq_len")):
        with pytest.raises(ConfigError, match=f"unknown option '{theirs}' \\(did you mean '{ours}'\\?\\)"):
            make_config({theirs: 1}, {})


def test_with_cuda_the_measured_device_peak_adds_what_torch_allocated_beside_the_pool(monkeypatch):
    """The planner's device peak counts activations on a GPU; the runtime's pool holds params and states.
    The figure to compare adds the allocator's peak beyond the pool; on CPU there is none to add."""
    import torch

    from tiertrain.train.metrics import device_peak_with_activations

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1000 + 300)
    assert device_peak_with_activations(400, 1000, torch.device("cuda", 0)) == 700
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 900)  # pool not full yet
    assert device_peak_with_activations(400, 1000, torch.device("cuda", 0)) == 400
    assert device_peak_with_activations(400, 1000, torch.device("cpu")) is None


def test_a_model_that_fits_the_host_budget_but_not_beside_the_budgets_is_built_on_the_meta_device(
        tmp_path, monkeypatch):
    """Under a memory cgroup's limit, budgets plus the model built whole in memory can exceed what the
    process may take while setup reserves the budgets: the model is then built on the meta device, and
    says why. Free memory, which varies from run to run, never decides how the weights are drawn."""
    import io

    import tiertrain.api.machine_budgets as budgets_module
    from tiertrain.train.metrics import Reporter

    def said(room: int, out) -> str:
        monkeypatch.setattr(budgets_module, "cgroup_room", lambda: room)
        text = io.StringIO()
        trainer = Trainer(tiny_config(out, plan="stream", device_memory="8MiB", host_memory="64MiB", steps=1),
                          Reporter(1, 1000, stream=text))
        trainer.close()
        return text.getvalue()

    budgets = (8 << 20) + (64 << 20)  # device + host: on a CPU both are host memory
    assert "beside the budgets" in said(budgets + (100 << 10), tmp_path / "capped")
    assert "meta device" not in said(None, tmp_path / "roomy")  # no cgroup limit


def test_a_step_line_names_each_tiers_peak_and_the_disk_tiers_pages_apart():
    """A disk plan's pages (12 GiB for the 1.31B) are no memory; each memory tier's peak is named (an H200
    run's line said "peak 27.48 GiB" beside a 6 GiB device budget: the host's), the device's with its
    activations where measured."""
    from tiertrain.train.metrics import step_memory

    row = {"peak_bytes": {"device": 1 << 20, "host": 3 << 20, "disk": 12 << 30}, "rss_bytes": {"now": 5 << 20}}
    assert step_memory(row) == "peak device 1.00 MiB host 3.00 MiB  disk 12.00 GiB  RSS 5.00 MiB"
    assert step_memory({"peak_bytes": {"host": 2 << 20}}) == "peak host 2.00 MiB"
    gpu = {"peak_bytes": {"device": 1 << 30, "device_with_activations": 3 << 30, "host": 2 << 30}}
    assert step_memory(gpu) == "peak device 3.00 GiB host 2.00 GiB"


def test_a_resume_counts_the_replicas_that_read_batches_not_the_ranks():
    """A pipeline's pp ranks read one replica's batches: 2 ranks at pp 2 take what one process takes."""
    from tiertrain.train.config import TrainConfig
    from tiertrain.train.schedule import batch_moved

    saved = {"batch_size": 2, "seq_len": 16, "grad_accum": 2, "pp": 2}
    one = TrainConfig(model="tiny", batch_size=2, seq_len=16, grad_accum=2, out="unused")
    assert batch_moved(saved, 2, one, 1) is None
    assert batch_moved(saved, 4, one, 2) is None  # 2 replicas of a 2-stage pipeline, 2 data-parallel ranks
    said = batch_moved(saved, 4, one, 1)
    assert "(2 data-parallel replicas -> 1)" in said and "resume with --nproc 4 --pp 2 to keep them" in said
    assert "(2 ranks -> 1)" in batch_moved({**saved, "pp": 1}, 2, one, 1)
