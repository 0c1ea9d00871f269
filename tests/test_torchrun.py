"""tiertrain under torchrun, as users launch it (issue 19): `tiertrain train --nproc N` (torchrun for one
machine) trains data parallel and writes a sharded checkpoint each rank writes its part of; it resumes
at another world size; a bad value is one message; a rank killed mid-step stops the others within a
bounded time, naming it, with nothing left behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import made, read_metrics

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--grad-clip", "0", "--log-every", "1"]


def _train(*args: str, timeout: float = 300, threads: int | None = None) -> subprocess.CompletedProcess:
    """``tiertrain train``; ``threads``: the process's (a one-process run compared bit for bit with ranks of
    that many threads each: this machine's BLAS sums a matmul in another order at another thread count)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return subprocess.run([sys.executable, "-m", "tiertrain", "train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def test_nproc_trains_data_parallel_writes_sharded_checkpoints_and_resumes_at_other_sizes(tmp_path):
    out = tmp_path / "run"
    r = _train(*TINY, "--plan", "stream", "--steps", "4", "--save-every", "2", "--out", str(out), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("done: 4 steps") == 1  # the summary is rank 0's
    ckpt = out / "checkpoints" / "step-00000002"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["config.json", "rng.safetensors", "shard-00000-of-00002.safetensors",
                     "shard-00000-of-00002.safetensors.pieces", "shard-00001-of-00002.safetensors",
                     "shard-00001-of-00002.safetensors.pieces", "trainer.json"]
    trainer = json.loads((ckpt / "trainer.json").read_text())
    assert trainer["shards"]["world"] == 2 and trainer["data_position"] == 4  # two ranks, two batches a step
    dp2 = _losses(out)
    kept = tmp_path / "kept"  # no --nproc: the resume trains on the checkpoint's two ranks, as the run did
    r = _train("--resume", str(ckpt), "--steps", "4", "--out", str(kept))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming on the checkpoint's 2 ranks (--nproc 2)" in r.stderr and "tokens a step" not in r.stdout
    assert _losses(kept) == dp2[2:]
    for world in (1, 4):  # the same state, read at another world size
        other = tmp_path / f"at{world}"
        r = _train("--resume", str(ckpt), "--steps", "4", "--out", str(other), "--nproc", str(world),
                   "--save-every", "1")
        assert r.returncode == 0, r.stderr[-3000:]
        assert (f"this run takes {128 * world:,} tokens a step where the checkpoint's took 256 (2 ranks -> "
                f"{world}): its losses part from the uninterrupted run's; resume with --nproc 2 to keep them") in r.stdout
        resumed = _losses(other)
        # step 3 is computed on the state of step 2 and the run's batch number 4, which rank 0 of every
        # world size draws first: the state read back at this size is the state the two ranks saved
        assert [r["step"] for r in read_metrics(other)] == [3, 4] and resumed[0] == dp2[2]
    again = tmp_path / "again"  # the one-process checkpoint the resharded run wrote at step 3, resumed
    r = _train("--resume", str(tmp_path / "at1" / "checkpoints" / "step-00000003"), "--steps", "4", "--out",
               str(again))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(again) == _losses(tmp_path / "at1")[1:]


def test_nproc_with_plan_auto_measures_on_rank_0_alone_and_every_rank_plans_alike(tmp_path, monkeypatch):
    """With nothing cached, rank 0 measures the page size and the profile (a model this small keeps the
    default disk depth) and rechecks the prediction after the first steps; rank 1 takes them and trains
    the same plan (a plan it chose apart could issue other collectives and hang)."""
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(made(tmp_path / "tmp")))  # where torchrun would leave its logs
    out = tmp_path / "auto"
    r = _train(*TINY, "--plan", "auto", "--update", "overlap", "--steps", "6", "--disk", f"{tmp_path / 'disk'}:256MiB",
               "--out", str(out), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert said.count("plan auto: profiling the model") == 1, said[-3000:]
    assert "rank 1 waiting for the model's profile" in r.stderr
    assert len(list((tmp_path / "cache").rglob("page_size/*.json"))) == 1  # measured once and cached
    assert (r.stdout + r.stderr).count("auto plan after 3 steps") == 1  # rank 0's line (its reporter's)
    assert "rank 1 waiting for" in r.stderr  # what rank 1 waited for, said
    assert len(_losses(out)) == 6
    left = [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(("torchelastic_", "tiertrain-"))]
    assert not left  # torchrun's agent logs removed (torch's inductor cache, shared by design, may stay)


def test_a_bad_value_under_nproc_is_one_message_before_anything_starts(tmp_path):
    r = _train(*TINY, "--plan", "stream", "--lr", "inf", "--out", str(tmp_path / "r"), "--nproc", "2")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == ["error: config: lr must be a finite number, got inf"]


def test_a_layout_the_ranks_would_refuse_is_one_message_before_torchrun_starts(tmp_path, capsys):
    from tiertrain.cli.main import main
    from tiertrain.plan import builtin_plan, data_parallel

    eight = tmp_path / "eight.json"
    eight.write_text(data_parallel(builtin_plan("stream", 2), 8).to_json())
    for args, says in ((["--model", "tiny-moe", "--plan", "stream", "--ep", "3"], "ep=3 does not divide the 2"),
                       ([*TINY, "--plan", str(eight)], "laid out for 8 ranks but --nproc is 2: use --nproc 8"),
                       ([*TINY, "--plan", "stream", "--shard-group", "3"], "groups of 3 ranks does not divide the 2"),
                       ([*TINY, "--shard-group", "2"], "--shard-group apply to a tiered run")):
        out = tmp_path / "r"
        assert main(["train", *args, "--out", str(out), "--nproc", "2"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("error:") == 1 and not out.exists(), err
    assert main(["train", *TINY, "--plan", "stream", "--ep", "2", "--out", str(tmp_path / "dense")]) == 2
    assert "this model has no mixture-of-experts layer" in capsys.readouterr().err
    assert main(["train", *TINY, "--plan", "stream", "--shard-group", "2", "--out", str(tmp_path / "one")]) == 2
    assert "hybrid sharding (shard_group=2)" in capsys.readouterr().err  # one process has no groups to split over


def test_an_error_inside_the_ranks_under_nproc_is_one_line_without_torchruns_report(tmp_path):
    r = _train(*TINY, "--plan", "stream", "--seq-len", "4096", "--out", str(tmp_path / "r"), "--nproc", "2")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "--seq-len 4096 exceeds" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "torch.distributed.elastic" not in r.stderr, r.stderr


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_a_rank_killed_mid_step_stops_the_other_naming_it_with_nothing_left(tmp_path):
    disk, out = tmp_path / "disk", tmp_path / "run"
    cmd = [sys.executable, "-m", "tiertrain", "train", *TINY, "--plan", "max-offload", "--disk", f"{disk}:256MiB",
           "--page-size", "64KiB", "--steps", "1000000", "--out", str(out), "--nproc", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1.0)  # well into training
        launcher = _children(proc.pid)
        workers = [w for child in launcher for w in _children(child)]
        assert len(workers) == 2, (launcher, workers)
        killed = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)  # local rank 1
        output, _ = proc.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and took < 60, (proc.returncode, took)
    assert "error: rank 1 of 2 stopped" in output, output[-3000:]
    assert all(not Path(f"/proc/{w}").exists() for w in workers)
    assert not disk.exists() or list(disk.iterdir()) == []  # the killed rank's disk tier too


def test_nproc_with_ep_trains_expert_parallel_and_its_checkpoint_resumes_at_ep2_and_in_one_process(tmp_path):
    """Each rank writes the experts it holds (rank 1's file holds experts 2 and 3 of every layer,
    under their own names); the checkpoint resumes at ep = 2 over two tensor-parallel groups of two
    (each expert cut over its group: the uninterrupted run's losses within the tensor-parallel tests'
    tolerance) and in one process holding every expert (rank 0's next loss as at ep = 2)."""
    moe = ["--model", "tiny-moe", "--batch-size", "2", "--seq-len", "16", "--grad-clip", "0", "--log-every", "1",
           "--plan", "stream"]
    out = tmp_path / "run"
    r = _train(*moe, "--steps", "4", "--save-every", "2", "--out", str(out), "--nproc", "2", "--ep", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    header = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("training ")]
    assert len(header) == 1 and "(52.80K params)" in header[0] and "64 tokens/step over 2 ranks" in header[0], header
    ckpt = out / "checkpoints" / "step-00000002"
    blocks = json.loads((ckpt / "trainer.json").read_text())["shards"]["blocks"]
    held = [b for b in blocks if b.get("rank") == 1]
    assert held and all(".experts.2." in b["params"][0][0] for b in held)
    ep2 = _losses(out)
    for world, ep, tp in ((4, 2, 2), (1, 1, 1)):
        other = tmp_path / f"at{world}"
        r = _train("--resume", str(ckpt), "--steps", "4", "--out", str(other), "--nproc", str(world), "--ep", str(ep),
                   "--tp", str(tp))
        assert r.returncode == 0, r.stderr[-3000:]
        assert [m["step"] for m in read_metrics(other)] == [3, 4], world
        if tp > 1:
            assert "each MoE layer's experts divided over 2 ranks" in r.stderr, r.stderr[-3000:]
            assert _losses(other) == pytest.approx(ep2[2:], rel=1e-5, abs=0)
        else:
            assert _losses(other)[0] == ep2[2]


def test_a_run_ends_its_process_group_before_the_interpreter_does(tmp_path):
    """Left to the interpreter's teardown, gloo's threads now and then aborted a rank after its run had
    finished (1 in 12-20 expert-parallel resumes); ``train`` ends the group itself once its run is over."""
    import torch.distributed as dist

    from tiertrain.parallel.group import end_process_group

    end_process_group()  # none up: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    end_process_group()
    assert not dist.is_initialized()
    # and a run that ended well ends it: one rank's group, as torchrun --nproc-per-node 1 would give
    from tiertrain.cli.main import main

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    try:
        assert main(["train", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                     "--out", str(tmp_path / "run"), "--quiet"]) == 0
        assert not dist.is_initialized()
    finally:
        end_process_group()  # a failed run must not leave the group to later tests in this process


DDP_REFERENCE = """
import json, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tiertrain.data import BatchSampler, load_tokens
from tiertrain.models import build, resolve_config
from tiertrain.train.config import SEQ_LEN, TrainConfig
from tiertrain.train.loop import model_vocab_and_len, seed_everything
from tiertrain.train.objective import causal_lm_pair, lm_loss
from tiertrain.train.optimizer import make_adamw
from tiertrain.train.schedule import lr_at
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = TrainConfig(steps=int(sys.argv[1]))  # the built-in default, as tiertrain train runs it
seed_everything(cfg.seed)
model = build(resolve_config(cfg.model))
vocab, max_len = model_vocab_and_len(model)
sampler = BatchSampler(load_tokens(cfg.data, vocab, cfg.tokenizer), cfg.batch_size, min(SEQ_LEN, max_len), cfg.seed,
                       rank=rank, world=world)
opt, _ = make_adamw(model, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
ddp, losses = DDP(model), []
for step in range(cfg.steps):
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg.lr, cfg.final_lr, cfg.warmup, cfg.steps)
    x, y = causal_lm_pair(sampler.next())
    loss = lm_loss(ddp, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
if rank == 0:
    print(json.dumps(losses))
dist.destroy_process_group()
"""


def test_torchrun_with_the_defaults_trains_plain_data_parallel_with_ddps_losses(tmp_path):
    """``torchrun --nproc-per-node 2 -m tiertrain train`` with no plan: the default run laid out over the
    ranks as plain data parallel (every block resident and replicated, gradients averaged, clipped by
    torch's own norm), where it was refused. Its losses are DDP's, bit for bit, on the same model, data
    and seed (the built-in default's clipping included)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                f"--log-dir={tmp_path / 'torchrun-logs'}"]  # torchrun would leave its own in TMPDIR
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*torchrun, "-m", "tiertrain", "train", "--steps", "5", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data parallel over 2 ranks, every block replicated on each rank (DDP)" in r.stderr
    script = tmp_path / "ddp.py"
    script.write_text(DDP_REFERENCE)
    ddp = subprocess.run([*torchrun, str(script), "5"], capture_output=True, text=True, timeout=300, env=env)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert _losses(tmp_path / "run") == json.loads(ddp.stdout.strip().splitlines()[-1])


UNTIED = {"name": "tiny-untied", "n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256,
          "max_seq_len": 64, "tie_embeddings": False}


def test_train_pp_trains_as_one_process_and_its_checkpoint_resumes_in_one_and_cut_otherwise(tmp_path):
    """``train --nproc 2 --pp 2`` (1F1B, 2 micro-batches) takes the steps of one process accumulating the same
    micro-batches, bit for bit (fp32, no clipping); its checkpoint after step 2 resumes in one process and over
    4 AIAO stages (2 segments), each going on with the uninterrupted run's losses. ``--nproc 4 --pp 2 --tp 2``
    (each stage's blocks cut over two ranks, the sequence sliced over them and between the stages, each block
    updated on the host as its gradients come: --update overlap) takes them within the tensor-parallel tests'
    tolerance, and its checkpoint holds a pipelined part per tensor-parallel rank, which a run at --tp 1
    resumes."""
    model = tmp_path / "untied.json"
    model.write_text(json.dumps(UNTIED))
    common = ["--model", str(model), "--batch-size", "2", "--seq-len", "32", "--grad-clip", "0", "--plan", "stream",
              "--log-every", "1"]
    piped = tmp_path / "piped"
    r = _train(*common, "--steps", "4", "--save-every", "2", "--nproc", "2", "--pp", "2", "--schedule", "1f1b",
               "--micro-batches", "2", "--out", str(piped))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline of 2 ranks x 1 replicas, 1f1b, 2 micro-batches, 2 stages" in r.stdout
    ckpt = piped / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "rng.safetensors", "stage-000", "stage-001",
                                                      "trainer.json"]
    one = tmp_path / "one"
    r = _train(*common, "--steps", "4", "--grad-accum", "2", "--out", str(one), threads=1)  # as each of the 2 ranks
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(piped) == _losses(one)
    # each tier's peak is the busiest rank's: the host pool held a stage's states, never the whole model's
    piped_peak, one_peak = (read_metrics(d)[-1]["peak_bytes"] for d in (piped, one))
    assert set(piped_peak) == {"device", "host"} and 0 < piped_peak["host"] < one_peak["host"], (piped_peak, one_peak)
    for name, args in (("in-one", ["--nproc", "1", "--pp", "1"]),
                       ("aiao", ["--nproc", "2", "--schedule", "aiao", "--segments", "2"])):
        r = _train("--resume", str(ckpt), "--steps", "4", "--out", str(tmp_path / name), *args, threads=1)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "tokens a step" not in r.stdout, r.stdout  # the same batches: one replica either way
        assert _losses(tmp_path / name) == _losses(piped)[2:], name
    cut = tmp_path / "pp-tp"
    r = _train(*common, "--steps", "4", "--save-every", "2", "--nproc", "4", "--pp", "2", "--tp", "2", "--schedule",
               "1f1b", "--micro-batches", "2", "--update", "overlap", "--sequence-parallel", "--out", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("pipeline of 2 ranks, each stage over 2 tensor-parallel ranks (sequence parallel) x 1 replicas"
            in r.stdout), r.stdout
    ckpt = cut / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "rng.safetensors", "tp-000", "tp-001",
                                                      "trainer.json"]
    assert sorted(p.name for p in (ckpt / "tp-001").iterdir()) == ["config.json", "rng.safetensors", "stage-000",
                                                                   "stage-001", "trainer.json"]
    assert _losses(cut) == pytest.approx(_losses(one), rel=1e-5, abs=0)
    r = _train("--resume", str(ckpt), "--steps", "4", "--nproc", "2", "--tp", "1", "--out", str(tmp_path / "tp1"))
    assert r.returncode == 0, r.stderr[-3000:]  # the saved --sequence-parallel stays, and a run at tp 1 leaves it
    assert _losses(tmp_path / "tp1") == pytest.approx(_losses(cut)[2:], rel=1e-5, abs=0)


def test_train_pp_plan_auto_plans_the_stages_once_and_the_ranks_and_the_resume_take_that_plan(tmp_path):
    """``--plan auto`` with ``--pp``: the stages are planned before torchrun starts (for the given layout, as
    ``plan --pp`` plans them) into the run directory's stage-plan.json, which every rank trains with and the
    resumed run takes again (its options name the file)."""
    from tiertrain.plan import Plan
    from tiertrain.plan.pipeline import fold

    out = tmp_path / "auto"
    r = _train("--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--plan", "auto", "--nproc", "2", "--pp",
               "2", "--schedule", "aiao", "--micro-batches", "2", "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    staged = out / "stage-plan.json"
    plan = Plan.from_json(staged.read_text(), "stage plan")
    assert plan.name.startswith("auto/") and len(plan.blocks) == max(map(len, fold(2, 2, 1)))  # a stage's blocks
    assert "--schedule aiao --segments 1 --micro-batches 2 --batch-size 2" in r.stdout, r.stdout
    assert json.loads((out / "checkpoints" / "step-00000002" / "trainer.json").read_text())["run_config"]["plan"] \
        == str(staged)
    r = _train("--resume", str(out), "--steps", "3")
    assert r.returncode == 0 and len(_losses(out)) == 3, r.stderr[-3000:]


def test_a_pipeline_the_ranks_would_refuse_is_one_message_before_torchrun_starts(tmp_path, capsys):
    from tiertrain.cli.main import main

    model = tmp_path / "untied.json"
    model.write_text(json.dumps(UNTIED))
    piped = ["--model", str(model), "--plan", "stream", "--nproc", "2", "--pp", "2"]
    for args, says in (([*piped[:4], "--pp", "2"], "add --nproc 2"),
                       ([*TINY, "--schedule", "gpipe"], "apply to a pipelined run; add --pp"),
                       ([*piped, "--schedule", "1f1b"], "give --micro-batches 2 or more"),
                       ([*piped[:-4], "--nproc", "2", "--pp", "3"], "--pp 3 does not divide the 2 ranks"),
                       ([*piped, "--micro-batches", "2", "--grad-accum", "4"], "name the same count"),
                       ([*piped[:2], "--nproc", "2", "--pp", "2"], "add --plan"),
                       ([*piped, "--precision", "fp16"], "use --precision bf16"),
                       ([*piped, "--update", "overlap"], "add --grad-clip 0, or use --update sync to clip"),
                       ([*piped, "--update", "lockfree"], "train --pp takes --update sync or overlap"),
                       ([*piped[:-4], "--nproc", "4", "--pp", "2", "--shard-group", "4"],
                        "groups of 4 ranks does not divide the 2 data-parallel ranks"),  # N / P replicas
                       ([*piped, "--ep", "2"], "ep=2 does not divide the 1 data-parallel ranks"),
                       (["--model", "tiny", *piped[2:], "--update", "overlap", "--grad-clip", "0"],
                        "a head tied to the embedding sums its two stages' gradients first")):
        out = tmp_path / "r"
        assert main(["train", *args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert says in err and err.count("error:") == 1 and not out.exists(), err


def test_train_tp_trains_as_one_process_and_its_checkpoint_resumes_in_one(tmp_path):
    """``train --nproc 2 --tp 2 --sequence-parallel`` (the tiny GPT's heads and MLP features cut over two
    ranks, the sequence between them sliced, clipped) takes
    one process's steps within the tensor-parallel tests' tolerance (tests/test_tensor_parallel.py says
    why); its checkpoint after step 2 (a sub-checkpoint per rank) resumes in one process with the
    uninterrupted run's losses."""
    common = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--plan", "stream", "--log-every", "1"]
    cut = tmp_path / "tp"
    r = _train(*common, "--steps", "4", "--save-every", "2", "--nproc", "2", "--tp", "2", "--sequence-parallel",
               "--out", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensor parallel over 2 ranks x 1 replicas, sequence parallel" in r.stdout
    ckpt = cut / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "rng.safetensors", "tp-000", "tp-001",
                                                      "trainer.json"]
    one = tmp_path / "one"
    r = _train(*common, "--steps", "4", "--out", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(cut) == pytest.approx(_losses(one), rel=1e-5, abs=0)
    r = _train("--resume", str(ckpt), "--steps", "4", "--out", str(tmp_path / "in-one"), "--nproc", "1", "--tp", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens a step" not in r.stdout, r.stdout  # one replica either way
    assert _losses(tmp_path / "in-one") == pytest.approx(_losses(cut)[2:], rel=1e-5, abs=0)


def test_a_plan_files_lockfree_is_refused_with_clipping_before_torchrun_but_not_for_a_pipeline(tmp_path):
    """A plan file saying lockfree, with train's default clipping: the ranks of a data-parallel run would each
    refuse it, so it is one message before torchrun starts; a pipeline's stages update as --update says (sync
    by default), so its run passes."""
    import dataclasses

    from tiertrain.cli.main import _check_layout
    from tiertrain.errors import ConfigError
    from tiertrain.plan import builtin_plan
    from tiertrain.train.config import make_config

    path = tmp_path / "lockfree.json"
    path.write_text(dataclasses.replace(builtin_plan("stream", 2), update="lockfree").to_json())
    with pytest.raises(ConfigError, match="lockfree updates take gradients as they come"):
        _check_layout(make_config({}, {"model": "tiny", "plan": str(path)}), 2)
    _check_layout(make_config({}, {"model": "tiny", "plan": str(path), "pp": 2}), 2)


def test_a_tensor_parallel_layout_the_ranks_would_refuse_is_one_message_before_torchrun_starts(tmp_path, capsys):
    from tiertrain.cli.main import main

    cut = ["--model", "tiny", "--plan", "stream", "--nproc", "2", "--tp", "2"]
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps({**UNTIED, "n_experts": 2}))
    for args, says in (([*cut[:4], "--tp", "2"], "add --nproc 2"),
                       ([*cut[:4], "--nproc", "3", "--tp", "2"], "--tp 2 must divide --nproc 3"),
                       ([*cut[:2], "--nproc", "2", "--tp", "2"], "add --plan"),
                       ([*cut, "--pp", "2"], "--pp 2 x --tp 2 must divide --nproc 2"),
                       (["--model", "tiny", *cut[2:-4], "--nproc", "4", "--pp", "2", "--tp", "2"],
                        "a tied embedding in a pipeline cut over tensor-parallel ranks"),
                       ([*cut, "--precision", "fp16"], "use --precision bf16"),
                       ([*cut, "--update", "lockfree"], "no clipping (grad_clip: 0), or --update overlap"),
                       ([*cut, "--update", "lockfree", "--grad-clip", "0", "--max-staleness", "2"],
                        "give --max-staleness 1 (a fixed lag of one step) or 0"),
                       ([*cut[:6], "--sequence-parallel"], "--sequence-parallel slices the sequence over a "
                                                           "tensor-parallel group: give --tp T"),
                       (["--model", str(moe), *cut[2:4], "--nproc", "4", "--tp", "2", "--pp", "2", "--ep", "2"],
                        "ep=2 does not divide the 1 data-parallel ranks"),  # N / (P x T) replicas
                       ([*cut, "--sequence-parallel", "--seq-len", "31"], "give a --seq-len that 2 divides (not 31)"),
                       (["--model", str(moe), *cut[2:], "--ep", "2"],
                        "ep=2 does not divide the 1 data-parallel ranks"),  # N / T replicas, not N ranks
                       ([*cut[:4], "--nproc", "4", "--tp", "2", "--shard-group", "4"],
                        "groups of 4 ranks does not divide the 2 data-parallel ranks")):
        out = tmp_path / "r"
        assert main(["train", *args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert says in err and err.count("error:") == 1 and not out.exists(), err
