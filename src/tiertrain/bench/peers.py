"""tiertrain beside the systems its users compare it with, on the same model, initial weights,
batches, precision and device budget, one after the other in one process.

- ``deepspeed``: ZeRO-3 with parameters and optimizer states offloaded to host memory (the
  ZeRO-Offload/Infinity setting that trains a model whose states exceed the device), where
  DeepSpeed is installed.
- ``fsdp2``: PyTorch FSDP2 (``fully_shard`` per block) with ``CPUOffloadPolicy``; in torch itself.

Every system gets the same AdamW (torch's fused CPU kernel; DeepSpeed through
``zero_force_ds_cpu_optimizer: false``): on these machines it beat DeepSpeed's CPUAdam, and it
needs no compiler where the peer runs. Peers have no device budget flag of their own, so on CUDA
every system, tiertrain too, runs under one ``torch.cuda.set_per_process_memory_fraction`` cap
(``PeerBench.device_cap``).
A peer that runs out of device memory runs again with every block's activations recomputed
(``torch.utils.checkpoint``), as its user would; its row says so.

The first step's loss is printed for each system: with one initial model and one batch they must
agree (to rounding at reduced precision), which shows the comparison is of the same work.

With a disk (``--disk DIR:SIZE``) states live on it: tiertrain's budgets include the disk, and
DeepSpeed runs as ZeRO-Infinity, parameters and optimizer states on NVMe through its ``aio`` op (built
at first use where ``libaio`` and a C++ compiler are: ``apt-get install libaio-dev g++``). Each row then
adds the bytes read and written per step (the disk's own counters, ``/proc/diskstats``), the process's
peak RSS (each system runs in a process of its own, ``_isolated``), and the step's disk bound: those
bytes at the raw rates measured on the same disk just before and just after that system's timed steps,
with nothing of its own in flight (``disk_bound``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tiertrain.bench.machine import synchronize
from tiertrain.bench.disk_bound import DiskLimit, measure_limit
from tiertrain.bench.overhead import matmul_peak
from tiertrain.autoplan.auto_plan import ProfileStep
from tiertrain.api.machine_budgets import meta_build_reason
from tiertrain.train.cpu_watch import process_times, usable_cores
from tiertrain.measure.diskstats import DiskCounters, disk_counters
from tiertrain.train.metrics import process_rss, restart_rss_peak
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw
from tiertrain.runtime.precision import Precision
from tiertrain.memory import Budgets
from tiertrain.memory.system import compute_device
from tiertrain.models import ModelConfig, build, flops_per_token, param_count
from tiertrain.precisions import torch_dtype
from tiertrain.runtime.blocks import find_block_list
from tiertrain.units import format_bytes

PEERS = ("deepspeed", "fsdp2")
_LR, _BETAS, _EPS, _WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


@dataclass(frozen=True)
class PeerBench:
    """What every system runs: one model, one budget, one list of batches."""

    cfg: ModelConfig
    batch: int
    seq: int
    precision: str
    budgets: Budgets
    steps: int
    warmup: int
    update: str
    probe_each_step: bool = False  # drain and measure the disk between timed steps (``_time_steps``)
    probe_bytes: int = 1 << 30     # each way, per disk probe
    cap: int | None = None  # on CUDA, every system's allocator cap (None: ``device_cap``'s default)

    @property
    def device_cap(self) -> int:
        """tiertrain's device pool maps what its plan counts, and its activations, like every system's,
        come from torch's allocator beside it, within the budget as the planner counted them; the
        default cap leaves 1 GiB beyond the budget, for what the planner's count of them misses."""
        return self.cap or self.budgets.device + (1 << 30)

    def batches(self, device: torch.device) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, self.cfg.vocab_size, (self.batch, self.seq + 1), generator=g).to(device)
                for _ in range(self.warmup + self.steps)]

    def fresh_model(self, meta: bool = False) -> nn.Module:
        """The same initial fp32 weights for every system (``meta``: shapes only, for tiertrain's setup
        to draw block by block where the whole model may not live beside its budgets)."""
        torch.manual_seed(0)
        return build(self.cfg, device="meta") if meta else build(self.cfg)


@dataclass
class Row:
    """One system's figures; ``note`` says why a row has none, or how it ran."""

    name: str
    step_s: list[float] = field(default_factory=list)
    cores_busy: list[float] = field(default_factory=list)  # per timed step: the process's CPU s / wall s
    losses: list[float] = field(default_factory=list)
    device_peak: int | None = None
    note: str = ""
    disk_bytes: tuple[float, float] | None = None   # read, written per timed step
    peak_rss: int | None = None
    limits: list[DiskLimit] = field(default_factory=list)  # the disk's raw rates before and after the steps
    step_disk: list[DiskCounters] = field(default_factory=list)  # what each step did to the disk (probed each)

    @property
    def ran(self) -> bool:
        return bool(self.step_s)


def _time_steps(step: Callable[[torch.Tensor], torch.Tensor], bench: PeerBench, device: torch.device,
                name: str, note: str = "", drain: Callable[[], None] = os.sync) -> Row:
    """Every batch once; the warm-up steps' losses are kept, their times are not. With a disk, its
    raw rates are measured just before the first timed step and just after the last, once ``drain``
    has let the system's own transfers land (a peer's: ``os.sync``). ``probe_each_step`` also drains
    and measures between timed steps: each step's time then includes its own write-backs, none
    overlapping the next step (slower than a steady run), and its bytes are paired with the rates on
    either side of it."""
    row = Row(name, note=note)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    disk, before = bench.budgets.disk_dir, None
    each = bool(disk) and bench.probe_each_step
    for i, x in enumerate(bench.batches(device)):
        if i == bench.warmup and disk:
            before = _probe(row, bench, drain)
        synchronize(device)
        began = process_times()
        loss = step(x)
        if each and i >= bench.warmup:
            drain()
        synchronize(device)
        if i >= bench.warmup:
            ended = process_times()
            row.step_s.append(ended.t - began.t)
            row.cores_busy.append((ended.cpu - began.cpu) / row.step_s[-1])
        if each and i >= bench.warmup and before is not None:
            row.step_disk.append(disk_counters(disk) - before)
            before = _probe(row, bench, drain)
        row.losses.append(float(loss))
    if row.step_disk:
        row.disk_bytes = (statistics.mean(d.read for d in row.step_disk),
                          statistics.mean(d.written for d in row.step_disk))
    elif before is not None:
        drain()  # the last step's write-backs are its bytes too
        done = disk_counters(disk) - before
        row.disk_bytes = (done.read / bench.steps, done.written / bench.steps)
    if disk and not each:
        _probe(row, bench, drain)
    if device.type == "cuda":
        row.device_peak = torch.cuda.max_memory_allocated(device)
    row.peak_rss = process_rss()["peak"]
    return row


def _probe(row: Row, bench: PeerBench, drain: Callable[[], None]) -> DiskCounters | None:
    """The disk's raw rates, once the system's own transfers have landed, added to the row; the
    device's counters after it (None where the disk directory is on no block device)."""
    drain()
    row.limits.append(measure_limit(Path(bench.budgets.disk_dir), bench.probe_bytes))
    return disk_counters(bench.budgets.disk_dir)


def _run_tiertrain(bench: PeerBench, device: torch.device) -> Row:
    import tiertrain

    why = meta_build_reason(4 * param_count(bench.cfg), bench.budgets, device)
    model = bench.fresh_model(meta=why is not None)
    opt, _ = make_adamw(model, _LR, _BETAS, _EPS, _WD)
    precision = Precision(bench.precision, device.type)
    probe = ProfileStep(model, lm_loss, bench.cfg.vocab_size, bench.batch, bench.seq, precision.autocast, device)
    tm, topt = tiertrain.setup(model, opt, bench.budgets, plan="auto", update=bench.update,
                               compute_dtype=bench.precision, profile_step=probe)

    def step(x: torch.Tensor) -> torch.Tensor:
        with precision.autocast():
            loss = lm_loss(tm, x[:, :-1], x[:, 1:])
        loss.backward()
        topt.step()
        topt.zero_grad()
        return loss.detach()

    try:
        notes = [tm.auto_plan.describe()] if tm.auto_plan is not None else []
        if why is not None:
            notes.append(f"its fp32 weights {why}: built on the meta device and drawn block by block by setup, "
                         "so its initial weights, and losses, are not the peers'")
        return _time_steps(step, bench, device, f"tiertrain ({bench.update})", "; ".join(notes),
                           tm.runtime.wait_updates)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


class _Recomputed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: object, **kwargs: object) -> object:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _blocks(model: nn.Module, recompute: bool) -> nn.ModuleList:
    _, layers = find_block_list(model)
    if recompute:
        for i in range(len(layers)):
            layers[i] = _Recomputed(layers[i])
    return layers


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _run_fsdp2(bench: PeerBench, device: torch.device, recompute: bool) -> Row:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    policy = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch_dtype(bench.precision), reduce_dtype=torch.float32)}
    model = bench.fresh_model()
    for block in _blocks(model, recompute):
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt, _ = make_adamw(model, _LR, _BETAS, _EPS, _WD)  # over the sharded params, on the host
    return _time_steps(_plain_step(model, opt), bench, device, "fsdp2 cpu-offload",
                       "recomputes every block" if recompute else "")


def _run_deepspeed(bench: PeerBench, device: torch.device, recompute: bool) -> Row:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines would bury the figures
    pin = device.type == "cuda"
    conf = {"train_micro_batch_size_per_gpu": bench.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": pin},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": pin}},
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 1 << 30}
    if device.type == "cuda":  # where the cap holds
        conf = _within_device_cap(conf, bench)
    if bench.budgets.disk_dir:
        conf = _on_nvme(conf, bench, pin)
    if bench.precision in ("bf16", "fp16"):
        conf[bench.precision] = {"enabled": True}
    model = bench.fresh_model()
    _blocks(model, recompute)
    opt, _ = make_adamw(model, _LR, _BETAS, _EPS, _WD)  # groups need the full shapes: before partitioning
    model.to(torch_dtype(bench.precision))  # DeepSpeed computes in its params' dtype and keeps fp32 masters itself
    # partition the built model (its weights as every system has them) onto the host, param by param
    deepspeed.zero.Init(module=model, config_dict_or_path=conf, remote_device="cpu", pin_memory=pin)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(engine, x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss.detach()

    try:
        name = "deepspeed zero3-infinity (nvme)" if bench.budgets.disk_dir else "deepspeed zero3-offload"
        return _time_steps(step, bench, device, name, "recomputes every block" if recompute else "")
    finally:
        engine.destroy()


def _within_device_cap(conf: dict, bench: PeerBench) -> dict:
    """ZeRO-3's device buffers sized as a user held to the cap would size them. Its defaults suit a
    whole GPU, not a cap: a gradient bucket of 5e8 elements (2 GB in fp32) and up to 1e9 parameters
    kept gathered between uses (every parameter of a model under 1e9, 1.4 GB for a 354M). The bucket
    sizes are transformers' DeepSpeed integration's "auto" values (from the hidden size); the gathered
    parameters are held to a quarter of the cap (counted in fp32)."""
    d, live = bench.cfg.d_model, bench.device_cap // 4 // 4
    zero = {**conf["zero_optimization"], "reduce_bucket_size": d * d, "stage3_prefetch_bucket_size": int(0.9 * d * d),
            "stage3_param_persistence_threshold": 10 * d, "stage3_max_live_parameters": live,
            "stage3_max_reuse_distance": live}
    return {**conf, "zero_optimization": zero}


def _on_nvme(conf: dict, bench: PeerBench, pin: bool) -> dict:
    """ZeRO-Infinity: parameters and optimizer states on the disk through DeepSpeed's aio (its
    documented NVMe settings; the parameter buffers must hold the largest tensor, the embedding, and
    so does each optimizer sub-group)."""
    largest = max(p.numel() for p in bench.fresh_model().parameters())
    nvme = os.path.join(bench.budgets.disk_dir, "deepspeed")
    os.makedirs(nvme, exist_ok=True)
    zero = {**conf["zero_optimization"],
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": pin, "buffer_count": 5,
                              "buffer_size": largest},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": pin, "buffer_count": 16,
                                  "pipeline_read": True, "pipeline_write": True}}
    # optimizer states are swapped a sub-group at a time through 16 buffers of one sub-group each:
    # DeepSpeed's default sub-group (1e9 elements, 4 GB a buffer) would pin 64 GB; one the size of the
    # largest tensor keeps its swaps as large as its parameter buffers
    zero["sub_group_size"] = largest
    return {**conf, "zero_optimization": zero,
            "aio": {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 1, "single_submit": False,
                    "overlap_events": True}}


@contextlib.contextmanager
def _single_rank_group(device: torch.device) -> Iterator[None]:
    """A world of one, which both peers need; env:// so DeepSpeed finds the same variables."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _device_cap(device: torch.device, cap: int) -> Iterator[None]:
    """Hold a system to ``cap`` bytes of the device (CUDA's caching allocator refuses past it)."""
    if device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _tiertrain_under_cap(bench: PeerBench, device: torch.device) -> Row:
    """tiertrain under the same allocator cap as the peers: its pools keep its budget by its own
    accounting, and running out of device memory here would show its activations over the rest."""
    restart_rss_peak()
    try:
        with _device_cap(device, bench.device_cap):
            return _run_tiertrain(bench, device)
    except torch.OutOfMemoryError as e:
        return Row(f"tiertrain ({bench.update})", note=f"out of device memory under {format_bytes(bench.device_cap)} "
                                                       f"(its device budget {format_bytes(bench.budgets.device)}): "
                                                       f"{str(e).splitlines()[0]}")
    finally:
        _release(device)


def _run_peer(name: str, bench: PeerBench, device: torch.device) -> Row:
    """One peer, again with recompute if it ran out of device memory; a missing or failing peer
    gives a row that says why (its traceback on stderr), so the others' figures still print."""
    runner = {"deepspeed": _run_deepspeed, "fsdp2": _run_fsdp2}[name]
    for recompute in (False, True):
        restart_rss_peak()
        try:
            with _device_cap(device, bench.device_cap), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the peers' own deprecations
                return runner(bench, device, recompute)
        except ImportError as e:
            return Row(name, note=f"not run: {e}; install it (pip install {name}) to compare with it")
        except torch.OutOfMemoryError:
            if recompute:
                return Row(name, note=f"out of device memory under {format_bytes(bench.device_cap)}, "
                                      "even recomputing every block")
        except Exception as e:  # noqa: BLE001 - a peer's own failure is a figure here, not our crash
            traceback.print_exc()
            return Row(name, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            _release(device)
    raise AssertionError("unreachable")


def _peer_alone(name: str, bench: PeerBench, device: torch.device) -> Row:
    with _single_rank_group(device):
        return _run_peer(name, bench, device)


def _isolated(name: str, run: Callable[..., Row], *args: object) -> Row:
    """One system in a process of its own (spawned, as torchrun would start it): what one system
    leaves behind (allocator caches, a peer's pinned or swap buffers, its process group) never
    weighs on the next, each peak RSS is that system's alone, and a system the kernel kills for
    memory is a row that says so, not the end of the benchmark (a 354M DeepSpeed ZeRO-Infinity run
    after tiertrain's in one process reached the machine's 24 GiB)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(run, *args).result()
        except BrokenProcessPool:
            return Row(name, note="its process was killed (out of memory? see the kernel log)")


@contextlib.contextmanager
def own_disk_dir(bench: PeerBench) -> Iterator[PeerBench]:
    """The bench with a private directory of its own under its disk directory, removed afterwards with
    all a peer left in it (DeepSpeed's NVMe swap files stay behind otherwise: 6.7 GB after a 354M run),
    also when the peer's process was killed."""
    if not bench.budgets.disk_dir:
        yield bench
        return
    mine = tempfile.mkdtemp(prefix="tiertrain-peer-", dir=bench.budgets.disk_dir)
    try:
        yield dataclasses.replace(bench, budgets=dataclasses.replace(bench.budgets, disk_dir=mine))
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def bench_peers(bench: PeerBench, peers: tuple[str, ...], out: Callable[[str], None]) -> list[Row]:
    """tiertrain, then each peer, on the same work; prints one line per system. The first row is
    tiertrain's: the caller should fail when it did not run."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    device = compute_device()
    rows = [_isolated(f"tiertrain ({bench.update})", _tiertrain_under_cap, bench, device)]
    for name in peers:
        with own_disk_dir(bench) as mine:
            rows.append(_isolated(name, _peer_alone, name, mine, device))
    peak = matmul_peak(device, "fp32" if bench.precision == "fp32" else "bf16")
    flops = flops_per_token(bench.cfg, bench.seq) * bench.batch * bench.seq
    cap = f"every system held to {format_bytes(bench.device_cap)} with set_per_process_memory_fraction" \
        if device.type == "cuda" else "not enforceable for peers on CPU"
    out(f"model {param_count(bench.cfg) / 1e6:.1f}M params, batch {bench.batch} x {bench.seq}, {bench.precision} "
        f"on {device.type}; device budget {format_bytes(bench.budgets.device)} ({cap}); "
        f"{bench.steps} timed steps after {bench.warmup} warm-up"
        + ("; each timed step waits for its own disk writes (--probe-each-step)" if bench.probe_each_step else ""))
    out(f"matrix product measured here: {peak / 1e12:.2f} TFLOP/s (the MFU ceiling)")
    for row in rows:
        if not row.ran:
            out(f"{row.name:24s}: {row.note}")
            continue
        s = statistics.median(row.step_s)
        mem = f", device peak {format_bytes(row.device_peak)}" if row.device_peak is not None else ""
        out(f"{row.name:24s}: step {s:.3f} s, {bench.batch * bench.seq / s:,.0f} tokens/s, MFU {flops / s / peak:.3f}"
            f"{mem}, CPU {statistics.median(row.cores_busy):.1f} of {usable_cores()} cores busy; loss "
            f"{row.losses[0]:.4f} -> {row.losses[-1]:.4f}")
        if bench.budgets.disk_dir:
            _disk_lines(row, s, out)
        if row.note:
            out(f"{'':26s}{row.note}")
    _against_tiertrain(rows, out)
    return rows


def _disk_lines(row: Row, step_s: float, out: Callable[[str], None]) -> None:
    """The disk's raw rates around a system's steps, its bytes per step, and the least time those
    bytes take at each measured rate beside the step."""
    whens = ["before its steps", "after its steps"] if len(row.limits) == 2 else \
        ["before its steps"] + [f"after its step {i + 1}" for i in range(len(row.limits) - 1)]
    for when, limit in zip(whens, row.limits):
        out(f"{'':26s}disk raw (1 MiB requests, 8 in flight, O_DIRECT where the filesystem allows), {when}: "
            f"{limit.describe()}")
    if row.step_disk:
        _per_step_lines(row, out)
    if row.disk_bytes is None:
        out(f"{'':26s}disk per step: not counted (the disk directory is on no block device in /proc/diskstats)")
        return
    read, wrote = row.disk_bytes
    bounds = [limit.seconds(read, wrote) for limit in (row.limits[0], row.limits[-1])]
    ratios = " / ".join(f"{step_s / b:.2f}" for b in bounds) if all(b > 0 for b in bounds) else "no disk traffic"
    out(f"{'':26s}disk per step: read {read / 1e9:.3f} GB, written {wrote / 1e9:.3f} GB; at the raw rates before / "
        f"after: {' / '.join(f'{b:.3f}' for b in bounds)} s (step / that: {ratios}); "
        f"peak RSS {format_bytes(row.peak_rss or 0)}")


def _per_step_lines(row: Row, out: Callable[[str], None]) -> None:
    """Each step (its write-backs drained) against the least time its bytes take at the raw rates
    measured just before and just after it: the disk's rate during the step lies near one of them."""
    ratios = []
    for i, (d, s) in enumerate(zip(row.step_disk, row.step_s)):
        bounds = [row.limits[i].seconds(d.read, d.written), row.limits[i + 1].seconds(d.read, d.written)]
        if min(bounds) <= 0:
            continue
        ratios.append((s / max(bounds), s / min(bounds)))
        out(f"{'':26s}step {i + 1}: {s:.3f} s with its write-backs, read {d.read / 1e9:.3f} GB, written "
            f"{d.written / 1e9:.3f} GB, disk busy {d.busy_s / s:.0%} of it; at the rates before / after it "
            f"{bounds[0]:.3f} / {bounds[1]:.3f} s (step / that {s / bounds[0]:.2f} / {s / bounds[1]:.2f})")
    if ratios:
        out(f"{'':26s}step / its disk bound, median over steps: {statistics.median(r for r, _ in ratios):.2f} "
            f"against the larger of its two bounds, {statistics.median(r for _, r in ratios):.2f} against the smaller")


def _against_tiertrain(rows: list[Row], out: Callable[[str], None]) -> None:
    """Each peer's step time and peak RSS over tiertrain's, the ratios users compare."""
    ours = rows[0]
    if not ours.ran:
        return
    for row in rows[1:]:
        if row.ran and row.peak_rss and ours.peak_rss:
            out(f"{row.name} / tiertrain: step {statistics.median(row.step_s) / statistics.median(ours.step_s):.2f}x, "
                f"peak RSS {row.peak_rss / ours.peak_rss:.2f}x")
