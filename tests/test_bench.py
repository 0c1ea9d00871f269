"""The benchmarks run and print their figures beside their limits (no timing is asserted)."""

import pytest

from conftest import run_cli


def test_bench_optimizer_prints_throughput_beside_the_bound_and_the_peer():
    r = run_cli("bench", "optimizer", "--d-model", "64", "--layers", "2", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    assert "of the bandwidth bound (target >= 0.80)" in r.stdout and "of torch fused" in r.stdout


def test_bench_offload_prints_step_time_beside_the_bound(tmp_path):
    r = run_cli("bench", "offload", "--d-model", "64", "--layers", "2", "--batch-size", "2", "--seq-len", "16",
                "--repeats", "1", "--page-size", "1MiB", "--disk", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    # sync, overlap, lockfree at staleness 1 and 4 (stream-disk); sync, lockfree x 2 (resident-disk); max-offload
    assert r.stdout.count("overlap efficiency") == 8 and r.stdout.count(") against sync") == 4
    assert r.stdout.count("staleness seen up to") == 4
    assert "raw O_DIRECT" in r.stdout
    assert list((tmp_path / "d").iterdir()) == []
    bad = run_cli("bench", "offload", "--max-staleness", "1,x")
    assert bad.returncode != 0 and "give whole numbers >= 0" in bad.stderr


def test_bench_planner_prints_each_figure_beside_its_limit(tmp_path):
    r = run_cli("bench", "planner", "--d-model", "64", "--layers", "2", "--batch-size", "2", "--seq-len", "16",
                "--steps", "2", "--disk-dir", str(tmp_path / "d"), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "limit 2 s" in r.stdout
    for plan in ("resident", "stream", "max-offload", "disk-homed", "lockfree ", "lockfree4"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(plan) and "predicted" in x)
        assert "limit 10%" in line and "limit 5%" in line
    assert r.stdout.count("auto against the best built-in") + r.stdout.count("auto trains where no built-in") == 3
    for profile in ("measured", "one block", "analytic"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(profile))
        assert " ms (" in line and "saved activations per block" in line
    assert list((tmp_path / "d").iterdir()) == []


def test_bench_tensor_prints_tp2_and_sequence_parallel_beside_tp1_with_the_bytes_each_rank_sent():
    """Each tensor-parallel run's bytes a rank sent per step equal its formula (sequence parallel's: gathers
    and reduce-scatters, the sequence gathered around the blocks, the whole gradients' sums), printed with
    its step beside one process's on the same cores."""
    r = run_cli("bench", "tensor", "--d-model", "64", "--layers", "2", "--rows", "2", "--seq-len", "16", "--steps",
                "1", "--sequence-parallel", timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    cut = [x for x in lines if x.startswith("tp 2")]
    assert len(cut) == 2 and "sequence parallel" in cut[1] and "sequence" not in cut[0], r.stdout
    for x in cut:
        assert "B: 1.000)" in x and "x the time" in x, x
    assert sum(x.startswith("tp 1 (1 process x 2 threads): step") for x in lines) == 1, r.stdout


def test_bench_streams_prints_each_stream_count_beside_one_with_its_losses_against_its_chunks_on_one_stream():
    """In process: each count's step beside one stream's, its losses equal to its chunks issued on one stream,
    within fp32 rounding of the whole batch's; too few rows for 4 streams refused before anything runs."""
    from tiertrain.bench.streams import StreamsBench, bench_streams

    lines = []
    got = bench_streams(StreamsBench(d_model=64, layers=2, rows=4, seq=16, steps=1), lines.append)
    assert sorted(got) == [1, 2, 4] and got[1]["vs_one"] == 1.0 and all(g["exact"] for g in got.values()), got
    assert all(g["off_whole"] < 1e-5 for g in got.values()) and len(lines) == 3, lines
    assert all("x one stream's); losses equal the same chunks on one stream" in x for x in lines), lines
    r = run_cli("bench", "streams", "--rows", "2")
    assert r.returncode != 0 and "give at least 4" in r.stderr


def test_bench_overhead_prints_plain_and_resident_beside_the_target():
    r = run_cli("bench", "overhead", "--d-model", "64", "--layers", "2", "--batch-size", "2", "--seq-len", "16",
                "--rounds", "2", "--steps", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("overhead against plain") == 2 and r.stdout.count("target <= 3%") == 2
    assert r.stdout.count("tokens/s, MFU") == 3 and "the MFU ceiling" in r.stdout
    for bad, says in ((("--update", "lockfree"), "no plain peer"), (("--rounds", "0"), "at least 1"),
                      (("--seq-len", "4096"), "exceeds the model's maximum")):
        r = run_cli("bench", "overhead", *bad)
        assert r.returncode != 0 and says in r.stderr


def test_bench_convergence_prints_sync_and_lockfree_loss_over_time(tmp_path, monkeypatch):
    from tiertrain.bench.convergence import bench_convergence

    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    got = bench_convergence(32, 2, 2, 32, 24, 2e-2, None, (1, 2), lines.append, page=64 << 10, points=4)
    text = "\n".join(lines)
    assert set(got) == {"equal_time_s", "sync", "lockfree1", "lockfree2", "fixed1"}
    for run in ("sync", "lockfree1", "lockfree2", "fixed1"):
        assert got[run]["last_steps_loss"] < got[run]["first_loss"] - 0.5  # both learn
        # a timing figure: on a loaded machine a run may not have stepped by then (no step ended: its first loss)
        assert got[run]["loss_at_equal_time"] <= got[run]["first_loss"] and got[run]["step_s"] > 0
    assert got["sync"]["staleness"] == 0 and 1 <= got["lockfree2"]["staleness"] <= 2  # its passes coalesce
    assert got["fixed1"]["staleness"] == 1  # exactly one step behind
    assert text.count("against sync") == 4 and "fastest run's second half" in text
    assert len([ln for ln in lines if ln.startswith("  ")]) == 4  # the curve's rows
    assert list(tmp_path.iterdir()) == []  # its runs and disk files are gone
    r = run_cli("bench", "convergence", "--max-staleness", "x")
    assert r.returncode != 0 and "give whole numbers >= 0" in r.stderr


def test_bench_peers_runs_tiertrain_and_each_peer_on_the_same_model_and_batches():
    import importlib.util
    import statistics

    from tiertrain.bench.peers import PeerBench, bench_peers
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, d_ffn=64, vocab_size=64, max_seq_len=32, name="peer")
    lines: list[str] = []
    rows = bench_peers(PeerBench(cfg, 2, 16, "fp32", Budgets.parse("256MiB", "1GiB"), 2, 1, "overlap"),
                       ("deepspeed", "fsdp2"), lines.append)
    by = {r.name.split()[0]: r for r in rows}
    assert set(by) == {"tiertrain", "deepspeed", "fsdp2"}
    ran = [r for r in rows if r.ran]
    for r in ran:
        assert len(r.step_s) == 2 and len(r.losses) == 3 and min(r.step_s) > 0
        assert len(r.cores_busy) == 2 and min(r.cores_busy) > 0, r.cores_busy  # each in its own process
        # one initial model and one batch: every system's first loss is the same figure
        assert abs(r.losses[0] - by["tiertrain"].losses[0]) < 1e-5, (r.name, r.losses, by["tiertrain"].losses)
    assert by["tiertrain"].ran and by["fsdp2"].ran
    if importlib.util.find_spec("deepspeed") is None:
        assert not by["deepspeed"].ran and "pip install deepspeed" in by["deepspeed"].note
    else:
        assert by["deepspeed"].ran, by["deepspeed"].note
    assert sum("tokens/s, MFU" in ln for ln in lines) == len(ran) and "the MFU ceiling" in "\n".join(lines)
    for r in ran:  # each system's line says how many cores it kept busy
        assert any(ln.startswith(r.name) and f"CPU {statistics.median(r.cores_busy):.1f} of " in ln for ln in lines)
    for bad, says in ((("--peers", "colossal"), "choose from deepspeed, fsdp2"),
                      (("--seq-len", "4096"), "exceeds the model's maximum"),
                      (("--device-memory", "1GiB", "--device-cap", "512MiB"), "give a cap at or above it")):
        r = run_cli("bench", "peers", *bad)
        assert r.returncode != 0 and says in r.stderr


def test_bench_parallel_prints_dp2_beside_dp1_with_the_bytes_each_rank_sent():
    r = run_cli("bench", "parallel", "--layouts", "ddp,zero3", "--d-model", "64", "--layers", "4", "--batch-size",
                "1", "--seq-len", "16", "--steps", "2", "--rounds", "1", timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for name, volume in (("DDP-like", 2.0), ("ZeRO-3-like", None)):
        i = next(k for k, x in enumerate(lines) if x.startswith(name))
        assert "dp=1 step" in lines[i] and "dp=2/dp=1" in lines[i]
        sent = float(lines[i + 1].split(" = ")[1].split(" x ")[0])  # counted bytes over (N-1)/N x params bytes
        want = volume or float(lines[i + 1].split("(volume ")[1].split()[0])
        assert want <= sent <= want + 0.01, lines[i + 1]  # the has-gradient flags on top: a byte per tensor
        assert "of the step exposed" in lines[i + 2]
    bad = run_cli("bench", "parallel", "--layouts", "fsdp")
    assert bad.returncode != 0 and "give some of ddp, zero2, zero3" in bad.stderr


def test_bench_pipeline_prints_each_schedules_step_and_exposed_sync_beside_1f1bs():
    r = run_cli("bench", "pipeline", "--schedules", "1f1b,aiao", "--d-model", "32", "--layers", "4", "--rows", "4",
                "--seq-len", "8", "--steps", "1", timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {x.split()[0]: x for x in r.stdout.splitlines() if x.split() and x.split()[0] in ("1f1b", "aiao")}
    assert "link: loopback" in r.stdout and set(rows) == {"1f1b", "aiao"}
    step = {k: float(v.split("step")[1].split("ms")[0]) for k, v in rows.items()}
    assert all(s > 0 for s in step.values()) and "exposed DP.sync" in rows["1f1b"]
    said = float(rows["aiao"].split("vs 1F1B: ")[1].split("x")[0])  # printed ms are rounded: within 0.01
    assert said == pytest.approx(step["1f1b"] / step["aiao"], abs=0.011)
    for bad, says in ((("--schedules", "zb"), "give some of 1f1b, interleaved, aiao"),
                      (("--layers", "3"), "4 pipeline stages (2 ranks x 2 segments) for a model of 3 blocks")):
        r = run_cli("bench", "pipeline", *bad)
        assert r.returncode != 0 and says in r.stderr


def test_bench_peers_with_a_disk_counts_each_systems_disk_bytes_and_peak_rss(tmp_path):
    import os

    from tiertrain.measure.diskstats import disk_counters
    from tiertrain.bench.peers import PeerBench, bench_peers
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig

    before = disk_counters(str(tmp_path))
    if before is None:
        import pytest

        pytest.skip(f"{tmp_path} is on no block device (tmpfs or overlay): nothing to count")
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    os.write(fd, os.urandom(64 << 20))  # more than a tick of the busy counter
    os.fsync(fd)
    os.close(fd)
    after = disk_counters(str(tmp_path))
    assert (after - before).written >= 8 << 20 and (after - before).busy_s > 0  # the disk's own counters
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=128, d_ffn=512, vocab_size=64, max_seq_len=32, name="peer")
    lines: list[str] = []
    rows = bench_peers(PeerBench(cfg, 2, 16, "fp32", Budgets.parse("2MiB", "8MiB", f"{tmp_path}:64MiB"), 2, 1,
                                 "sync", probe_bytes=64 << 20), ("deepspeed",), lines.append)
    ran = [r for r in rows if r.ran]
    assert rows[0].ran and all(r.disk_bytes is not None and r.peak_rss > 100 << 20 for r in ran)
    assert all(len(r.limits) == 2 and min(r.limits[0].read, r.limits[1].together) > 0 for r in ran)
    assert sum("before its steps: read" in ln for ln in lines) == sum("after its steps: read" in ln for ln in lines) \
        == len(ran)
    assert sum("disk per step: read" in ln and "peak RSS" in ln for ln in lines) == len(ran)
    assert not any(p.name.startswith(".tiertrain-probe-") for p in tmp_path.rglob("*"))  # the probes' files went
    r = run_cli("bench", "peers", "--disk", f"{tmp_path}:1GiB")
    assert r.returncode != 0 and "FSDP2 offloads to host memory only" in r.stderr


def test_bench_peers_can_set_each_step_against_the_disk_rates_measured_on_either_side_of_it(tmp_path):
    """``probe_each_step``: a probe after every timed step, each step's own bytes, and a line per step
    with its bounds at the probes before and after it; tiertrain alone (no peers) is allowed."""
    from tiertrain.measure.diskstats import disk_counters
    from tiertrain.bench.peers import PeerBench, bench_peers
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig

    if disk_counters(str(tmp_path)) is None:
        import pytest

        pytest.skip(f"{tmp_path} is on no block device (tmpfs or overlay): nothing to count")
    cfg = ModelConfig(n_layer=12, n_head=2, d_model=256, d_ffn=1024, vocab_size=64, max_seq_len=32, name="peer")
    lines: list[str] = []  # 150 MB of states, 80 MiB of host: the plan homes them on disk; 8 MiB of device
    #                        hold a streamed block, the activations and a gradient autograd makes
    bench = PeerBench(cfg, 2, 16, "fp32", Budgets.parse("8MiB", "80MiB", f"{tmp_path}:512MiB"), 3, 1, "overlap", True,
                      probe_bytes=64 << 20)
    (row,) = bench_peers(bench, (), lines.append)
    assert row.ran and len(row.limits) == 4 and len(row.step_disk) == 3, lines
    assert all(d.read > 0 and d.written > 0 and 0 < d.busy_s <= s + 0.1 for d, s in zip(row.step_disk, row.step_s))
    assert row.disk_bytes == (sum(d.read for d in row.step_disk) / 3, sum(d.written for d in row.step_disk) / 3)
    assert [sum(f"after its step {i}:" in ln for ln in lines) for i in (1, 2, 3)] == [1, 1, 1]
    assert sum(ln.strip().startswith("step ") and "at the rates before / after it" in ln for ln in lines) == 3
    assert any("step / its disk bound, median over steps" in ln for ln in lines)
    assert not any(p.name.startswith(".tiertrain-probe-") for p in tmp_path.rglob("*"))
    r = run_cli("bench", "peers", "--peers", "", "--probe-each-step")
    assert r.returncode != 0 and "give --disk DIR:SIZE too" in r.stderr


def test_bench_peers_builds_tiertrains_model_on_the_meta_device_where_it_may_not_live_beside_the_budgets(
        monkeypatch):
    """Under a memory cgroup whose room cannot hold the whole model beside the budgets, tiertrain's
    model is built on the meta device (setup draws it block by block), as train builds it, and its row
    says its initial weights are not the peers'; with room, it is built whole, as the peers' are."""
    import torch

    import tiertrain.api.machine_budgets as budgets_module
    from tiertrain.bench.peers import PeerBench, _run_tiertrain
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, d_ffn=256, vocab_size=64, max_seq_len=32, name="peer")
    bench = PeerBench(cfg, 2, 16, "fp32", Budgets.parse("8MiB", "64MiB"), 2, 1, "sync")
    monkeypatch.setattr(budgets_module, "cgroup_room", lambda: (72 << 20) + (16 << 10))  # budgets and 16 KiB
    capped = _run_tiertrain(bench, torch.device("cpu"))
    assert capped.ran and "built on the meta device" in capped.note, capped.note
    monkeypatch.setattr(budgets_module, "cgroup_room", lambda: None)
    roomy = _run_tiertrain(bench, torch.device("cpu"))
    assert roomy.ran and "meta device" not in roomy.note
    assert capped.losses != roomy.losses  # drawn block by block: other initial weights


def test_a_disk_bound_is_the_faster_of_one_after_the_other_and_the_common_part_at_once():
    from tiertrain.bench.disk_bound import DiskLimit

    fast_together = DiskLimit(read=1e9, write=2e9, together=4e9)
    assert fast_together.seconds(3e9, 1e9) == 2e9 / 4e9 + 2e9 / 1e9     # 1 GB each way at once, 2 GB read alone
    assert fast_together.seconds(1e9, 3e9) == 2e9 / 4e9 + 2e9 / 2e9
    slow_together = DiskLimit(read=1e9, write=2e9, together=1e9)
    assert slow_together.seconds(3e9, 1e9) == 3e9 / 1e9 + 1e9 / 2e9     # apart is faster: the disk may do that
    assert slow_together.seconds(0, 0) == 0


def test_the_loss_at_equal_time_is_a_number_when_a_run_finished_no_step_in_the_window():
    import numpy as np

    from tiertrain.bench.convergence import Curve

    c = Curve("slow", np.array([0.5, 0.9, 1.2]), np.array([5.0, 4.0, 3.0]), 0)
    assert c.mean_between(0.5, 1.0) == 4.0       # the steps that ended inside
    assert c.mean_between(0.95, 1.1) == 4.0      # none inside: the last that ended by then
    assert c.mean_between(0.1, 0.4) == 5.0       # none ended yet: the initial model's loss


def test_each_peer_gets_a_private_disk_directory_removed_with_what_it_left(tmp_path):
    from pathlib import Path

    from tiertrain.bench.peers import PeerBench, own_disk_dir
    from tiertrain.memory import Budgets
    from tiertrain.models import ModelConfig

    (tmp_path / "theirs").write_text("a user's file")
    bench = PeerBench(ModelConfig(n_layer=1, n_head=1, d_model=8, d_ffn=8, vocab_size=16, max_seq_len=8), 1, 4,
                      "fp32", Budgets(1 << 20, 1 << 20, 1 << 30, str(tmp_path)), 1, 0, "sync")
    with own_disk_dir(bench) as mine:
        work = Path(mine.budgets.disk_dir)
        assert work.parent == tmp_path and work.stat().st_mode & 0o077 == 0
        (work / "deepspeed").mkdir()
        (work / "deepspeed" / "swap.bin").write_bytes(b"x" * 4096)  # what a peer leaves
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]
