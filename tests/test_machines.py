"""Machine descriptions (issue 20): typed JSON, built-in datasheets, probes that know the load they ran
under, planning for a described machine, and the largest model a machine trains."""

import dataclasses
import io
import json
import subprocess
import sys
import time

import pytest

from conftest import load_meter

from tiertrain.errors import ConfigError
from tiertrain.planner.machine import Link, Load, Machine, PerDtype

MiB, GiB = 1 << 20, 1 << 30


def small_machine(**changes) -> Machine:
    """A CPU-only machine of made-up rates (its device tier is host RAM, as here)."""
    m = Machine(name="small", device="cpu", device_memory=8 * GiB, host_memory=8 * GiB,
                peak_flops=PerDtype(0.0, 0.0, 0.0), matmul_flops=PerDtype(2e11, 1e12, 2e11), memory_bps=2e10,
                h2d_bps=1e10, d2h_bps=1e10, disk_read_bps=2e9, disk_write_bps=2e9, adam_params_per_s=1e9,
                disk_bytes=64 * GiB, page_size=64 << 10, network=(Link("eth", 1.25e9),), source="test",
                load=Load(others_cores=0.0, cores=2))
    return dataclasses.replace(m, **changes)


def test_a_machine_description_round_trips_through_json_and_is_checked_field_by_field(tmp_path):
    from tiertrain.planner.datasheets import BUILTIN, UnknownMachine, find_machine

    assert {"h100-sxm-80gb", "h200", "a100-80gb", "a100-40gb", "rtx-4090", "v100-32gb"} <= set(BUILTIN)
    for m in (*BUILTIN.values(), small_machine()):
        assert Machine.from_json(m.to_json()) == m
    path = tmp_path / "m.json"
    path.write_text(small_machine().to_json())
    assert find_machine(str(path)) == small_machine() and find_machine("h200") is BUILTIN["h200"]
    data = json.loads(small_machine().to_json())
    with pytest.raises(ConfigError, match="disk_read_bps must be > 0"):
        Machine.from_json(json.dumps({**data, "disk_read_bps": 0}))
    with pytest.raises(ConfigError, match="did you mean 'h2d_bps'"):
        Machine.from_json(json.dumps({**data, "h2d_bpz": 1}))
    with pytest.raises(ConfigError, match="matmul_flops: bf16 must be a number"):
        Machine.from_json(json.dumps({**data, "matmul_flops": {"fp32": 1.0, "bf16": "fast", "fp16": 1.0}}))
    with pytest.raises(UnknownMachine, match="tiertrain probe --out"):
        find_machine("h1000")
    # a machine without a rate for the plan's precision says so (the V100 has no bf16)
    with pytest.raises(ConfigError, match="no bf16 matmul rate"):
        BUILTIN["v100-32gb"].matmul("bf16")


def test_the_planner_modules_load_no_torch():
    code = ("import sys; import tiertrain.planner.machine, tiertrain.planner.datasheets, tiertrain.planner.retarget; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'tiertrain.models', "
            "'tiertrain.memory', 'tiertrain.runtime'))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_profile_carried_to_another_machine_scales_compute_by_its_rates():
    """Twice the matmul rate and twice the memory bandwidth halve every roofline time, so every block
    time halves; links, disk and optimizer become the target's; the same machine changes nothing;
    a block without recorded work scales by the matmul rates alone."""
    from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
    from tiertrain.planner.retarget import for_machine

    here = small_machine()
    there = dataclasses.replace(here, name="twice", matmul_flops=PerDtype(4e11, 2e12, 4e11), memory_bps=4e10,
                                disk_read_bps=1e8)
    worked = BlockProfile("b", 0.3, 0.6, 1000, 10, 5, recompute_s=0.3, flops=1e9, traffic_bytes=1e6)
    bare = BlockProfile("b", 0.3, 0.6, 1000, 10, 5)
    p = Profile((worked, bare), worked, MachineProfile(1e9, 1e9, 1e9, 1e9, 1e9), compute_dtype="fp32")
    moved = for_machine(p, here, there)
    assert [b.forward_s for b in moved.blocks] == pytest.approx([0.15, 0.15])
    assert moved.blocks[0].recompute_s == pytest.approx(0.15) and moved.rest.backward_s == pytest.approx(0.3)
    assert moved.machine == there.rates() and moved.machine.disk_read_bps == 1e8
    slower_memory = dataclasses.replace(there, memory_bps=1e10)  # memory-bound work: only its share slows
    mixed = for_machine(p, here, slower_memory).blocks
    assert mixed[0].forward_s > 0.15 and mixed[1].forward_s == pytest.approx(0.15)
    same = for_machine(p, here, here)
    assert same.blocks == p.blocks and same.machine == here.rates()


def _cli(*args: str) -> int:
    from tiertrain.cli.main import main

    return main(list(args))


def _request(**changes):
    from tiertrain.cli.plan import PlanRequest

    base = dict(model="gpt-small", batch=2, seq=64, precision="fp32", device_memory="16MiB", host_memory="48MiB",
                disk=None, profile_file=None, solvers=("dp",), levels=None, page_size=None, update="sync",
                max_staleness=1, grad_clip=1.0, grad_accum=1, machine=None, max_model=False, measure_memory=None,
                measure_seconds=None)
    return PlanRequest(**{**base, **changes})


def test_two_machines_differing_only_in_disk_bandwidth_move_the_bottleneck_as_the_simulator_says(tmp_path):
    """The same model and budgets, its states on disk (the host cannot hold them): on a fast disk the
    step is bound by something else; with a disk 1000x slower, by the disk, and the step takes at
    least its disk time (reads and writes share the disk at once), as the simulation of the chosen plan
    says; the printout says so too."""
    from rich.console import Console

    from tiertrain.cli.plan import run_plan

    fast = small_machine(device="cuda", device_memory=GiB, host_memory=GiB, disk_read_bps=5e9, disk_write_bps=5e9)
    slow = dataclasses.replace(fast, disk_read_bps=5e6, disk_write_bps=5e6)
    assert [f.name for f in dataclasses.fields(Machine) if getattr(fast, f.name) != getattr(slow, f.name)] == \
        ["disk_read_bps", "disk_write_bps"]
    sims = {}
    for name, m in (("fast", fast), ("slow", slow)):
        (tmp_path / f"{name}.json").write_text(m.to_json())
        console = Console(record=True, width=200)
        chosen = run_plan(_request(machine=str(tmp_path / f"{name}.json"), disk=f"{tmp_path}:1GiB"), console).chosen
        assert any(b.home.value == "disk" for b in chosen.plan.blocks)
        assert f"bottleneck {chosen.sim.bottleneck}" in console.export_text()
        sims[name] = chosen.sim
    assert not sims["fast"].bottleneck.startswith("disk") and sims["slow"].bottleneck.startswith("disk")
    slow_sim = sims["slow"]
    disk_s = max(slow_sim.timeline.busy("disk_read"), slow_sim.timeline.busy("disk_write"))
    assert slow_sim.step_s >= disk_s - 1e-9 and slow_sim.step_s > 10 * sims["fast"].step_s


def _stub_depth(monkeypatch, gain: float) -> list:
    """The disk's depth measurement (12-20 s on a fresh cache) stubbed: a disk that moves reads and
    writes at once ``gain`` times as fast as in turns; returns the (directory, page) it was asked for."""
    from tiertrain.measure import disk_depth

    asked = []

    def measured(disk_dir, page, total=0):
        asked.append((disk_dir, page))
        return disk_depth.DiskDepth(4, 2, {4: 2e9}, gain * 2e9, 2e9)

    monkeypatch.setattr(disk_depth, "measured_depth", measured)
    return asked


def test_planning_for_the_probed_description_gives_the_same_plan_as_planning_here(tmp_path, monkeypatch, capsys):
    """`tiertrain probe --out m.json` then `plan --machine m.json`: the same plan, prediction and page
    size as `plan` on this machine with no --machine (the probe is kept: the test holds the load quiet)."""
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(Load, "busy", property(lambda self: False))
    disk = tmp_path / "disk"
    _stub_depth(monkeypatch, 1.5)
    assert _cli("probe", "--disk", str(disk), "--out", str(tmp_path / "m.json")) == 0
    assert "x1.50 their speed in turns" in " ".join(capsys.readouterr().out.replace("│", " ").split())
    probed = Machine.read(tmp_path / "m.json")
    assert probed.matmul_flops.fp32 > 0 and probed.load is not None and probed.page_size > 0
    assert probed.disk_together_gain == 1.5
    # a device budget below the model's fp32 params (4 blocks of 3.2 MB), so blocks stream
    common = ["plan", "--model", "gpt-small", "--batch", "2", "--seq", "64", "--device-memory", "8MiB",
              "--host-memory", "64MiB", "--disk", f"{disk}:4GiB"]
    assert _cli(*common, "--out", str(tmp_path / "here.json")) == 0
    here = capsys.readouterr().out
    assert _cli(*common, "--machine", str(tmp_path / "m.json"), "--out", str(tmp_path / "there.json")) == 0
    there = capsys.readouterr().out
    assert (tmp_path / "here.json").read_text() == (tmp_path / "there.json").read_text()
    assert here.splitlines()[-7:-1] == there.splitlines()[-7:-1]  # the prediction, peaks and every solver's
    assert "predicted step" in here and "planned for" not in here
    assert any(b["stream"] for b in json.loads((tmp_path / "here.json").read_text())["blocks"])
    # in process, to the last bit: the same simulated step and peaks
    from rich.console import Console

    from tiertrain.cli.plan import run_plan

    quiet = Console(file=io.StringIO())
    flags = dict(model="gpt-small", batch=2, seq=64, device_memory="8MiB", host_memory="64MiB",
                 disk=f"{disk}:4GiB", solvers=())
    tight = flags | {"host_memory": "44MiB", "update": "overlap", "grad_clip": 0.0}  # states on disk
    for f in (flags, tight):
        a, b = (run_plan(_request(**f, **m), quiet).chosen for m in ({}, {"machine": str(tmp_path / "m.json")}))
        assert a.plan == b.plan and a.sim.step_s == b.sim.step_s and a.sim.peaks == b.sim.peaks
    # the described gain is what the simulator takes: on a disk slow enough to bound the step, the same
    # description whose disk takes reads and writes in turns plans a slower step
    steps = {}
    for gain in (1.5, 1.0):
        slow = json.loads((tmp_path / "m.json").read_text()) | {"disk_read_bps": 2e7, "disk_write_bps": 2e7,
                                                                  "disk_together_gain": gain}
        (tmp_path / f"slow{gain}.json").write_text(json.dumps(slow))
        chosen = run_plan(_request(**tight, machine=str(tmp_path / f"slow{gain}.json")), quiet).chosen
        assert chosen.sim.bottleneck.startswith("disk")
        steps[gain] = chosen.sim.step_s
    assert steps[1.5] < steps[1.0] / 1.2, steps
    # a run that names its page size keeps reads first (it measures no depth): planned on one lane
    named = [run_plan(_request(**tight, machine=str(tmp_path / f"slow{gain}.json"), page_size="64KiB"), quiet).step_s
             for gain in (1.5, 1.0)]
    assert named[0] == named[1], named


def test_a_probe_taken_while_the_machine_is_busy_is_not_cached(tmp_path, monkeypatch):
    from tiertrain.measure import cache, load
    from tiertrain.measure import machine as probing

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path))
    others = {"cores": 1.5}
    monkeypatch.setattr(probing, "LoadMeter", load_meter(others))
    busy = probing.probe(None, use_cache=False)
    assert busy.load.busy and cache.load("machine", probing.probe_key(None)) is None
    others["cores"] = 0.05
    quiet = probing.probe(None)
    assert not quiet.load.busy and cache.load("machine", probing.probe_key(None))["load"]["others_cores"] == 0.05
    assert probing.probe(None) == quiet  # from the cache now
    del load


def test_the_probe_keeps_the_median_of_several_disk_measurements_not_one_taken_in_a_dip(tmp_path, monkeypatch):
    from tiertrain.measure import cache, page_size
    from tiertrain.measure import machine as probing
    from tiertrain.measure.disk import DiskRates

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(page_size, "measured_page_size", lambda *a, **k: 1 << 20)
    writes = iter([0.26e9, 1.7e9, 1.6e9, 3.3e9, 1.8e9])  # the first in a dip (a run's own write-backs beside it)
    seen = []

    def measure(directory, page, total, in_flight, verify=False):
        seen.append((page, total, in_flight, verify))
        return DiskRates(read_bps=2e9, write_bps=next(writes), cpu_s_per_byte=1e-10)

    class Quiet:  # this shared machine is often busy, and a busy probe is not cached
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.load = Load(others_cores=0.0, cores=2)

    monkeypatch.setattr(probing, "measure_disk", measure)
    monkeypatch.setattr(probing, "LoadMeter", Quiet)
    monkeypatch.setattr(probing, "_copies", lambda *a: (1e10, 1e10))
    depths = _stub_depth(monkeypatch, 1.5)
    found = probing.probe(str(tmp_path), use_cache=False)
    assert len(seen) == probing.DISK_ROUNDS and all(s == (MiB, 64 * MiB, 8, True) for s in seen)
    assert found.disk_write_bps == 1.7e9 and found.disk_read_bps == 2e9
    # the gain for reads and writes at once: not measured by the probe (an auto plan measures it at its
    # run's page size), but for `tiertrain probe` and `plan`, at the page size the probe found
    assert depths == [] and found.disk_together_gain == 1.0
    gained = probing.with_disk_gain(found, str(tmp_path))
    assert depths == [(str(tmp_path), MiB)] and gained.rates().disk_together_gain == 1.5
    assert cache.load("machine", probing.probe_key(str(tmp_path)))["disk_write_bps"] == 1.7e9


def test_the_probe_times_each_precisions_product_at_the_size_where_one_takes_long_enough(monkeypatch):
    """A CPU without fp16 kernels took 57 s for one 2048-square fp16 product: the size grows only
    while a product is quick, so where every product is slow enough (a bound of 0 s) all stay at 256."""
    import torch

    from tiertrain.measure import machine

    timed = []
    monkeypatch.setattr(machine, "_rate", lambda fn, amount, repeat=3: timed.append(amount) or 1.0)
    monkeypatch.setattr(machine, "MATMUL_CALL_S", 0.0)
    machine._matmuls(torch.device("cpu"), lambda: None)
    assert timed == [2 * 256**3] * 3
    timed.clear()
    monkeypatch.setattr(machine, "MATMUL_CALL_S", float("inf"))  # every product quick: up to the top size
    monkeypatch.setattr(machine, "PRECISIONS", ("fp32",) * 3)
    machine._matmuls(torch.device("cpu"), lambda: None)
    assert timed == [2 * 2048**3] * 3


def test_the_load_meter_sees_another_process_taking_the_cores():
    from tiertrain.measure.load import LoadMeter

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with LoadMeter() as meter:
            time.sleep(1.0)
    finally:
        hog.kill()
        hog.wait()
    assert meter.load.others_cores >= 0.5 and meter.load.busy
    with LoadMeter() as mine:  # our own work is not "others"
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    assert mine.load.others_cores < meter.load.others_cores


def test_max_model_agrees_with_the_budget_check(tmp_path):
    """On a small machine the answer's plan passes the runtime's budget check; the next larger models
    (one block deeper at its width, and the family's next) fit no plan: the DP finds none, and the
    runtime refuses even the most frugal plan (every block streamed through one slot, recomputed,
    states on disk, one block read ahead) in the device budget its activations leave the pools."""
    from tiertrain.autoplan.largest_model import RunShape, gpt3_shape, largest_model, model_fits, profile_for
    from tiertrain.planner.costs import activation_bytes
    from tiertrain.memory import Budgets
    from tiertrain.models import build, param_count
    from tiertrain.plan import builtin_plan
    from tiertrain.plan.fit import fits
    from tiertrain.runtime.blocks import block_sizes, find_blocks

    machine, page = small_machine(), 64 << 10
    # 256 MiB: the device holds the family's embedding, its gradient as autograd makes it and the logits
    # (a 2-block width-256 member takes 130 MB of them); at 128 MiB only a 1-block width-128 member fits, and
    # deepening that one plans models of a thousand blocks
    sizes = Budgets(device=256 * MiB, host=GiB, disk=8 * GiB)
    run = RunShape(batch=1, seq=64, precision="fp32", update="sync", needs_all_grads=True, max_staleness=1, page=page)
    found = largest_model(machine, sizes, run)
    budgets = Budgets(sizes.device, sizes.host, sizes.disk, str(tmp_path))
    assert found.cfg.n_layer >= found.family.n_layer > 1 and found.params == param_count(found.cfg)
    assert found.params < found.bound_params
    blocks = find_blocks(build(found.cfg, device="meta"))
    assert fits(block_sizes(blocks), found.chosen.plan, budgets, page)
    assert found.chosen.sim.peaks["device"] <= sizes.device and found.chosen.sim.peaks["host"] <= sizes.host

    def frugal(n: int):
        p = builtin_plan("max-offload", n, disk=True)
        return dataclasses.replace(p, window=1, prefetch=0, read_ahead=1, update_workers=1)

    for bigger in (gpt3_shape(found.cfg.n_layer + 1, found.cfg.d_model, 64), gpt3_shape(found.family.n_layer + 1, seq=64)):
        assert not model_fits(bigger, machine, sizes, run), bigger.name
        plan = frugal(bigger.n_layer)  # its pools get the device budget less what the compute holds beside them
        pools = dataclasses.replace(budgets, device=budgets.device - activation_bytes(plan, profile_for(bigger, machine, run)))
        assert not fits(block_sizes(find_blocks(build(bigger, device="meta"))), plan, pools, page), bigger.name


def test_max_model_from_the_command_line_prints_the_answer_beside_the_capacity_bound(tmp_path, capsys):
    rc = _cli("plan", "--max-model", "--machine", "a100-40gb", "--precision", "bf16", "--update", "overlap",
              "--grad-clip", "0", "--out", str(tmp_path / "plan.json"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "largest GPT-3-shaped model that fits" in out and "capacity bound" in out and "predicted step" in out
    # a V100 has no bf16 (the machine refuses it): it is planned in fp16, as the README's table does
    assert _cli("plan", "--max-model", "--machine", "v100-32gb", "--precision", "bf16", "--out",
                str(tmp_path / "v100.json")) == 2
    assert "plan with another --precision" in capsys.readouterr().err
    assert _cli("plan", "--max-model", "--machine", "v100-32gb", "--precision", "fp16", "--out",
                str(tmp_path / "v100.json")) == 0
    assert "largest GPT-3-shaped model that fits: 40 blocks x width 4864" in capsys.readouterr().out


def test_bench_description_predicts_three_plans_from_the_description_beside_their_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Load, "busy", property(lambda self: False))
    (tmp_path / "m.json").write_text(small_machine().to_json())
    rc = _cli("bench", "description", "--d-model", "64", "--layers", "2", "--batch-size", "2", "--seq-len", "16",
              "--steps", "1", "--rounds", "1", "--disk-dir", str(tmp_path / "disk"), "--machine", str(tmp_path / "m.json"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FLOP estimate at small's rates" in out
    for plan in ("resident", "stream", "disk-homed"):
        line = next(x for x in out.splitlines() if x.startswith(plan))
        assert "from the description" in line and "predicted/measured" in line
