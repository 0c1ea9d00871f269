"""What a step moves, counted where it happens and held against what the planner predicts: the
bytes the disk tier reads and writes (``metrics.jsonl``'s ``disk_bytes``), and the process's
resident memory beside the tiers' page peaks (``rss_bytes``)."""

import os
import time
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, tiny_config
from tiertrain.train.loop import train
from tiertrain.models import build
from tiertrain.plan import Plan
from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
from tiertrain.planner.simulator import simulate
from tiertrain.runtime.blocks import find_blocks

SECTOR = 4096  # the disk tier moves whole sectors: each chunk's bytes rounded up to one
CHUNKS = 3     # a state transfer moves three chunks (master, both moments); a fetch one
WIDER = {"n_layer": 2, "n_head": 2, "d_model": 128, "d_ffn": 512, "vocab_size": 256, "max_seq_len": 64}


def _predicted_disk_bytes(plan: Plan, model_name: str | dict) -> tuple[float, float, int]:
    """(read, written) per step by the simulator, for the model's real parameter counts (the times do
    not matter for bytes: a task's busy seconds times its rate), and how many chunk transfers it
    counts (each of whose chunks the runtime rounds up to a sector)."""
    blocks = find_blocks(build(model_name))
    counts = [sum(p.numel() for _, p in b.params) for b in blocks]
    prof = [BlockProfile(b.name, 1e-3, 2e-3, n, 0, 0) for b, n in zip(blocks, counts)]
    m = MachineProfile(h2d_bps=1e9, d2h_bps=1e9, disk_read_bps=2e9, disk_write_bps=1e9, adam_params_per_s=1e8,
                       device_is_host=True)
    sim = simulate(plan, Profile(tuple(prof[:-1]), prof[-1], m))
    transfers = sum(1 for resource, _, _, _ in sim.timeline.tasks if resource in ("disk_read", "disk_write"))
    return sim.timeline.busy("disk_read") * 2e9, sim.timeline.busy("disk_write") * 1e9, transfers


def _variant(tmp_path: Path, name: str) -> str:
    """max-offload, and ``mixed``: the second block's states on the host and resident (some blocks'
    states on disk, some not); ``host-master``: the first block's and the rest's masters on the host
    (only their moments cross to disk), the second block's all on disk; ``pieces``: max-offload with
    every block updated in pieces."""
    import dataclasses

    from tiertrain.plan import builtin_plan
    from tiertrain.plan.tiers import Tier

    plan = builtin_plan("max-offload", 2, disk=True)
    if name == "mixed":
        plan = dataclasses.replace(plan, blocks=(plan.blocks[0], dataclasses.replace(plan.blocks[1], home=Tier.HOST,
                                                                                       stream=False)))
    elif name == "host-master":
        plan = dataclasses.replace(plan, blocks=(dataclasses.replace(plan.blocks[0], host_master=True), plan.blocks[1]),
                                   rest=dataclasses.replace(plan.rest, host_master=True))
    elif name == "pieces":  # every state updated 16 KiB at a time (a tiny block's are ~50 KB)
        plan = dataclasses.replace(plan, blocks=tuple(dataclasses.replace(b, piece=PIECE) for b in plan.blocks),
                                   rest=dataclasses.replace(plan.rest, piece=PIECE))
    path = tmp_path / f"{name}.json"
    path.write_text(plan.to_json())
    return str(path)


PIECE = 16 << 10


@pytest.mark.parametrize("plan", ["max-offload", "mixed", "host-master", "pieces"])
def test_the_disk_bytes_a_sync_step_moves_are_the_simulators_up_to_sector_rounding(tmp_path, plan):
    out = tmp_path / "run"
    page = "16KiB" if plan == "pieces" else "64KiB"
    plan = _variant(tmp_path, plan)
    train(tiny_config(out, steps=4, plan=plan, disk=f"{tmp_path / 'disk'}:64MiB", page_size=page,
                      update="sync", save_every=2))  # what a checkpoint reads is no step's
    rows = read_metrics(out)
    ran = Plan.from_json((out / "plan.json").read_text())
    read, written, transfers = _predicted_disk_bytes(ran, "tiny")
    assert written > 0 and any(bp.home.value == "disk" for bp in (*ran.blocks, ran.rest))
    assert all(bp.piece == PIECE for bp in ran.blocks) == (plan.endswith("pieces.json"))
    for row in rows[1:]:  # the first step's blocks are in their slots from setup: nothing fetched
        got = row["disk_bytes"]
        assert 0 <= got["read"] - read < transfers * CHUNKS * SECTOR, (got, read, transfers)
        assert 0 <= got["written"] - written < transfers * CHUNKS * SECTOR, (got, written, transfers)


def test_each_disk_step_says_how_much_of_it_the_disk_was_busy_and_the_summary_gives_the_median(tmp_path):
    """``disk_busy``: the share of the step the disk directory's device had requests in flight (its
    own counters), where that directory is on a block device; the summary prints the median."""
    import io
    import statistics

    from rich.console import Console

    from tiertrain.cli.summary import print_summary
    from tiertrain.measure.diskstats import disk_counters

    (tmp_path / "disk").mkdir()
    if disk_counters(str(tmp_path / "disk")) is None:
        pytest.skip(f"{tmp_path} is on no block device (tmpfs or overlay): no counters to read")
    out = tmp_path / "run"
    summary = train(tiny_config(out, steps=4, plan="max-offload", disk=f"{tmp_path / 'disk'}:64MiB",
                                page_size="64KiB", update="sync"))
    rows = read_metrics(out)
    assert all(0 <= r["disk_busy"] <= 1 for r in rows[1:]), rows  # a tiny step may end within one tick: 0
    assert summary.disk_busy == pytest.approx(statistics.median(r["disk_busy"] for r in rows[2:]))  # after warm-up
    for r in rows:  # the step split into the phases the loop marks: together they are the whole row
        phases = r["disk_phases"]
        assert set(phases) == {"forward", "backward", "step", "between"}, phases
        assert {k: sum(p[k] for p in phases.values()) for k in ("read", "written")} == r["disk_bytes"], r
        assert all("busy" in p for p in phases.values()), phases  # on a block device: each phase has its share
        assert sum(p["s"] for p in phases.values()) >= r["step_s"], r  # the step's time, and the row's writing
        assert sum(phases[p]["s"] for p in ("forward", "backward", "step")) <= r["step_s"], r  # the row's is not
    assert sum(r["disk_phases"]["step"]["written"] for r in rows) > 0  # sync updates run (and write) in step()
    assert summary.disk_busy_phases == pytest.approx(
        {p: statistics.median(r["disk_phases"][p]["busy"] for r in rows[2:]) for p in ("forward", "backward", "step")})
    text = io.StringIO()
    print_summary(summary, Console(file=text, width=200))
    assert f"disk busy       {summary.disk_busy:.0%} of a step" in text.getvalue()
    assert f"forward {summary.disk_busy_phases['forward']:.0%}, backward " in text.getvalue()
    plain = train(tiny_config(tmp_path / "host", steps=2, plan="max-offload", page_size="64KiB"))
    assert plain.disk_busy is None and "disk_busy" not in read_metrics(tmp_path / "host")[-1]


def test_the_disk_watch_counts_the_time_the_device_was_busy_between_two_readings(tmp_path):
    """64 MiB written and synced between two readings keep the device busy for more than a tick; the
    bytes are the disk tier's own count, whatever else the device did."""
    from tiertrain.train.disk_watch import DiskWatch
    from tiertrain.measure.diskstats import disk_counters

    if disk_counters(str(tmp_path)) is None:
        pytest.skip(f"{tmp_path} is on no block device (tmpfs or overlay): no counters to read")

    class Tier:
        traffic = {"read": 0, "written": 0}

        def disk_traffic(self) -> dict[str, int]:
            return dict(self.traffic)

    mem = Tier()
    watch = DiskWatch(mem, str(tmp_path))
    watch.mark("forward")
    time.sleep(0.05)
    watch.mark("backward")  # the writes below are backward's, the idle time before them forward's
    mem.traffic = {"read": 5, "written": 7}
    with open(tmp_path / "f", "wb") as f:
        f.write(os.urandom(64 << 20))
        f.flush()
        os.fsync(f.fileno())
    row = watch.since_last()
    assert row["disk_bytes"] == {"read": 5, "written": 7} and 0 < row["disk_busy"] <= 1, row
    phases = row["disk_phases"]
    assert (phases["backward"]["read"], phases["backward"]["written"]) == (5, 7) and phases["backward"]["busy"] > 0
    assert (phases["forward"]["read"], phases["forward"]["written"]) == (0, 0) and phases["forward"]["s"] >= 0.05
    assert watch.since_last()["disk_bytes"] == {"read": 0, "written": 0}
    mem.traffic = {"read": 9, "written": 11}
    watch.skip_device()  # a machine probe meanwhile: the tier's bytes still count, the device's time not
    assert watch.since_last()["disk_bytes"] == {"read": 4, "written": 4}
    assert "disk_busy" not in DiskWatch(mem, None).since_last()
    assert disk_counters(str(tmp_path / "gone")) is None


def test_each_row_reports_the_process_resident_memory_beside_the_tier_peaks(tmp_path):
    """The steps' RSS peak apart from setup's: setup holds the caller's model beside the pools (here
    a 256 MiB buffer stands for it, touched and freed before the steps), a peak the steps never see."""
    import torch

    from tiertrain.train.loop import Trainer

    out = tmp_path / "run"
    trainer = Trainer(tiny_config(out, steps=3, plan="max-offload", page_size="64KiB", device_memory="64MiB",
                                  host_memory="192MiB"))
    held = torch.ones(256 << 18)  # 256 MiB, every page touched
    del held
    summary = trainer.run()
    rows = read_metrics(out)
    peaks = [r["rss_bytes"]["peak"] for r in rows]
    assert all(50 << 20 < r["rss_bytes"]["now"] <= r["rss_bytes"]["peak"] for r in rows)  # torch alone holds more
    # VmHWM is the kernel's high-water mark, raised lazily (a page freed without unmapping may leave it
    # below an RSS read before): equal within a few MiB, not to the byte
    slack = 4 << 20
    assert all(a <= b + slack for a, b in zip(peaks, peaks[1:])) and peaks[-1] <= _hwm_now() + slack
    setup = {r["rss_bytes"]["setup_peak"] for r in rows}
    assert setup == {summary.setup_rss} and summary.setup_rss > peaks[-1] + (200 << 20)
    assert peaks[-1] <= summary.rss_peak + slack
    assert summary.budgets == 256 << 20
    assert "disk_bytes" not in rows[0] and set(rows[0]["peak_bytes"]) >= {"device", "host"}


def _hwm_now() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_setup_frees_the_original_weights_while_the_caller_keeps_its_optimizer(tmp_path, monkeypatch):
    """A caller keeps the optimizer it made (a loop, a scheduler built on it): its param groups held
    every original weight, a model's worth of memory beyond the budgets. They now name the
    slot-backed parameters, and the originals are gone: each block's as soon as that block is built,
    so setup never holds the whole initial model beside the pools it has filled."""
    import gc
    import weakref

    import tiertrain
    from tiered_harness import TINY4, _fresh
    from tiertrain.memory import Budgets
    from tiertrain.runtime import build

    model, opt = _fresh(TINY4)
    originals = [weakref.ref(p) for p in model.parameters()]
    first_block = [weakref.ref(p) for p in model.blocks[0].parameters()]
    alive_at_build, real_build = [], build._build

    def counting_build(*args, **kwargs):
        alive_at_build.append(sum(r() is not None for r in first_block))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(build, "_build", counting_build)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=8 << 20, host=64 << 20), plan="stream", page_size=64 << 10)
    try:
        # blocks are built in model order: the first block's weights are gone before the second is built
        assert alive_at_build[:2] == [len(first_block), 0], alive_at_build
        gc.collect()
        assert all(r() is None for r in originals)
        live = {id(p) for p in tm.parameters()}
        assert all(id(p) in live for g in opt.param_groups for p in g["params"])
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


@pytest.mark.parametrize("update", ["sync", "overlap"])
def test_with_one_place_a_slot_filled_from_disk_gives_its_master_and_the_bytes_are_the_simulators(tmp_path, update):
    """The second block's slot is filled from its master on disk and backward reaches it first; the first
    block's master stays on the host. With one read-ahead place, forward reads only the second block's
    moments (its master stays put for the slot's fills), and that master is copied from the slot as its
    backward begins, not read from disk a third time: the step's bytes are the simulator's, which
    counts the same (in overlap forward also reads the first block's moments, into a worker's place)."""
    import dataclasses

    import tiertrain
    from tiered_harness import _fresh, _loop
    from tiertrain.memory import Budgets
    from tiertrain.plan import builtin_plan

    plan = builtin_plan("max-offload", 2, disk=True)
    plan = dataclasses.replace(plan, read_ahead=1, update=update,
                               blocks=(dataclasses.replace(plan.blocks[0], host_master=True), plan.blocks[1]))
    model, opt = _fresh(WIDER)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path)), plan=plan,
                               page_size=64 << 10)
    rt = tm.runtime
    rt.mode.close()  # setup widens read-ahead to what the budgets hold: the plan's one place here
    rt.take_plan(rt.groups, dataclasses.replace(plan, resolved=rt.plan.resolved))
    try:
        assert rt.groups[1].fills_slot_from_disk and not rt.groups[0].fills_slot_from_disk
        _loop(tm, topt, None, 1, 1, None)  # the first step's blocks are in their slots from setup
        rt.wait_updates()
        before = rt.mem.disk_traffic()
        _loop(tm, topt, None, 1, 1, None)
        rt.wait_updates()
        got = {k: v - before[k] for k, v in rt.mem.disk_traffic().items()}
    finally:
        rt.close()
        rt.mem.close()
    read, _, transfers = _predicted_disk_bytes(plan, WIDER)
    assert transfers * CHUNKS * SECTOR < 4 * rt.groups[1].layout.numel  # a master's read would show
    assert 0 <= got["read"] - read < transfers * CHUNKS * SECTOR, (got, read, transfers)


def _hold_copies_out_of_slots(monkeypatch) -> list[str]:
    """Every copy out of a device slot into another tier held back 50 ms before it starts; the names of
    the slots so copied, in order."""
    from tiertrain.memory.movement import Mover

    scatter, held = Mover._scatter, []

    def late_out_of_a_slot(dst, dst_start, src, src_start, n):
        if src.name.startswith("slot.") and dst.tier is not src.tier:
            held.append(src.name)
            time.sleep(0.05)
        scatter(dst, dst_start, src, src_start, n)

    monkeypatch.setattr(Mover, "_scatter", staticmethod(late_out_of_a_slot))
    return held


@pytest.mark.parametrize("update", ["sync", "overlap"])
def test_a_slot_whose_master_is_still_being_copied_out_is_not_refilled_and_training_stays_exact(
        tmp_path, monkeypatch, update):
    """A master copied from its slot (``StateMoves.read_ahead``) is copied on a copy worker while backward
    goes on; the device cache refills that slot (here with the block two ahead, prefetched) only once the
    copy is done. Every copy out of a slot is held back 50 ms before it starts, so a refill that did not
    wait would hand the update another block's parameters as its master: the losses stay plain PyTorch's."""
    from tiered_harness import TINY4, train_plain, train_tiered
    from tiertrain.memory import Budgets
    from tiertrain.plan import builtin_plan

    held = _hold_copies_out_of_slots(monkeypatch)
    plan = builtin_plan("max-offload", 4, disk=True, update=update)
    got, _ = train_tiered(TINY4, 3, 1, None, plan, Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path)))
    assert len(held) >= 4, held  # masters did come from slots
    assert got == train_plain(TINY4, 3, 1, None)


@pytest.mark.parametrize("update", ["sync", "overlap"])
def test_a_block_applied_twice_copies_its_master_out_of_its_slot_once_and_training_stays_exact(
        tmp_path, monkeypatch, update):
    """A block the forward applies twice (weights shared between two places) begins its backward twice;
    the second begins while the first's copy of its master out of the slot is still held back, and must
    not move that master again (``StateMoves._master_from``: it is already on its way)."""
    import torch.nn.functional as F

    from tiered_harness import TINY4, train_plain, train_tiered
    from tiertrain.memory import Budgets
    from tiertrain.models.gpt import GPT
    from tiertrain.plan import builtin_plan

    def second_block_twice(self, idx, targets=None):
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1])))
        for i, block in enumerate(self.blocks):
            x = block(block(x)) if i == 1 else block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    monkeypatch.setattr(GPT, "forward", second_block_twice)
    held = _hold_copies_out_of_slots(monkeypatch)
    plan = builtin_plan("max-offload", 4, disk=True, update=update)
    got, _ = train_tiered(TINY4, 3, 1, None, plan, Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path)))
    assert held.count("slot.1") >= 3, held  # the shared block's master did come from its slot
    assert got == train_plain(TINY4, 3, 1, None)


def test_the_cpu_watch_splits_the_process_cpu_seconds_by_phase_and_gives_the_kernels_share():
    """Cores busy = CPU seconds over wall seconds, for the whole row and each phase marked; the kernel's
    share of the row's CPU seconds. Readings given by hand: (user, kernel, wall)."""
    from tiertrain.train.cpu_watch import CpuTimes, CpuWatch

    readings = iter([CpuTimes(0.0, 0.0, 0.0),   # reset
                     CpuTimes(0.1, 0.0, 0.1),   # forward begins: 0.1 s "between" at one core
                     CpuTimes(0.5, 0.1, 0.4),   # backward begins: forward 0.5 CPU s in 0.3 s
                     CpuTimes(0.6, 0.3, 1.4),   # step begins: backward 0.3 CPU s in 1.0 s
                     CpuTimes(0.9, 0.3, 1.6),   # the row: step 0.3 CPU s in 0.2 s
                     CpuTimes(0.9, 0.3, 2.6),   # next row's reset point, then a second row all "between"
                     CpuTimes(1.0, 0.4, 3.6)])
    watch = CpuWatch(lambda: next(readings))
    for phase in ("forward", "backward", "step"):
        watch.mark(phase)
    got = watch.since_last()["cpu"]
    assert got["cores"] == pytest.approx(1.2 / 1.6)
    assert got["kernel"] == pytest.approx(0.3 / 1.2)
    assert got["phases"] == pytest.approx({"between": 1.0, "forward": 0.5 / 0.3, "backward": 0.3, "step": 1.5})
    assert got["phase_s"] == pytest.approx({"between": 0.1, "forward": 0.3, "backward": 1.0, "step": 0.2})
    watch.reset()  # a checkpoint: its second of wall time and no CPU is no step's
    second = watch.since_last()["cpu"]
    assert (second["cores"], second["kernel"]) == pytest.approx((0.2, 0.5))
    assert second["phases"] == pytest.approx({"between": 0.2})


def test_the_cpu_watch_counts_every_thread_of_the_process_and_not_a_waiting_one():
    """A phase whose main thread waits while another thread of the process computes (an update worker
    beside backward) is busy; one where every thread waits is not. The bounds are wide: they tell a
    reading of the process from one of the calling thread, or of the wall clock."""
    import threading

    from tiertrain.train.cpu_watch import CpuWatch

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    watch = CpuWatch()
    watch.mark("forward")
    worker = threading.Thread(target=spin)
    worker.start()
    time.sleep(0.3)
    stop.set()
    worker.join()
    watch.mark("backward")
    time.sleep(0.3)
    phases = watch.since_last()["cpu"]["phases"]
    assert phases["forward"] > 0.4 and phases["backward"] < 0.4, phases


def test_each_row_says_how_many_cores_the_step_kept_busy_and_the_summary_gives_the_median(tmp_path):
    """``cpu``: the cores busy per step and per phase, beside the disk's figures; the summary prints
    the medians after warm-up against the cores this process may use."""
    import io
    import statistics

    from rich.console import Console

    from tiertrain.cli.summary import print_summary

    out = tmp_path / "run"
    summary = train(tiny_config(out, steps=4, plan="max-offload", page_size="64KiB"))
    rows = read_metrics(out)
    for r in rows:
        assert set(r["cpu"]["phases"]) == {"forward", "backward", "step", "between"}, r["cpu"]
        assert 0 < r["cpu"]["cores"] <= summary.cores + 0.5 and 0 <= r["cpu"]["kernel"] <= 1, r["cpu"]
    assert summary.cores == len(os.sched_getaffinity(0))
    assert summary.cpu_cores == pytest.approx(statistics.median(r["cpu"]["cores"] for r in rows[2:]))  # after warm-up
    assert summary.cpu_phases == pytest.approx(
        {p: statistics.median(r["cpu"]["phases"][p] for r in rows[2:]) for p in ("forward", "backward", "step")})
    text = io.StringIO()
    print_summary(summary, Console(file=text, width=200))
    assert summary.cpu_kernel == pytest.approx(statistics.median(r["cpu"]["kernel"] for r in rows[2:]))
    assert f"CPU busy        {summary.cpu_cores:.1f} of {summary.cores} cores (median of a step, " \
           f"{summary.cpu_kernel:.0%} of it in the kernel" in text.getvalue()
    assert f"forward {summary.cpu_phases['forward']:.1f}, backward " in text.getvalue()
