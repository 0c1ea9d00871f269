"""The plain training loop: the numerical reference every offloading mode is compared against.

Read top to bottom it is one step of training: draw a batch, forward under the chosen
precision, backward (accumulated over ``grad_accum`` micro-batches), unscale, clip,
step, record. Everything else (config, checkpoints, metrics) lives in its own module.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tiertrain.data import BatchSampler, load_tokens
from tiertrain.checkpoint.atomic import write_atomic
from tiertrain.autoplan.auto_plan import AutoPlan, ProfileStep
from tiertrain.checkpoint.run import (TrainerState, checkpoint_root, find_checkpoint, load_checkpoint,
                                         save_checkpoint)
from tiertrain.api.machine_budgets import meta_build_reason
from tiertrain.train.config import SEQ_LEN, TrainConfig
from tiertrain.train.cpu_watch import CpuWatch, usable_cores
from tiertrain.train.disk_watch import BACKWARD, BETWEEN, FORWARD, PHASES, STEP, DiskWatch
from tiertrain.measure.load import LoadMeter
from tiertrain.planner.machine import Load
from tiertrain.train.metrics import (MetricsFile, NoMetrics, Reporter, StepMedians, StepTimer,
                                      device_peak_with_activations, peak_bytes, process_rss, restart_rss_peak)
from tiertrain.parallel import rank_from_env, world_from_env
from tiertrain.train.objective import causal_lm_pair, is_encoder, lm_loss, masked_lm_pair
from tiertrain.train.optimizer import make_adamw
from tiertrain.runtime.precision import Precision, choose_device, choose_precision
from tiertrain.train.run_dir import METRICS_FILE, PLAN_FILE, RunDir
from tiertrain.train.schedule import batch_moved, lr_at, schedule_moved
from tiertrain.train.stop import StopFlag
from tiertrain.train.tiered import default_budgets, setup_tiered
from tiertrain.checkpoint.train_state import PlainState, TieredState, TrainState
from tiertrain.errors import CheckpointError, ConfigError, OutputError, UserError
from tiertrain.memory import Tier
from tiertrain.models import build, config_vocab_and_len, flops_per_token, param_count, resolve_config
from tiertrain.models.config import ModelConfig
from tiertrain.units import format_bytes, format_count


WARMUP_STEPS = 2  # steps before a run's timings settle (allocations, the cache's recorded access order)


class TrainingDiverged(UserError):
    """The loss or the gradient norm stopped being a finite number."""


@dataclass
class RunSummary:
    steps: int
    first_loss: float
    last_loss: float
    tokens_per_s: float
    tflops: float
    seconds: float
    checkpoint: Path | None
    out: Path
    losses: list[float] = field(default_factory=list)
    stopped_early: bool = False
    disk_busy: float | None = None   # median share of a step (after warm-up) its disk was busy
    disk_busy_phases: dict[str, float] = field(default_factory=dict)  # ... of each phase (``PHASES``)
    cpu_cores: float | None = None   # median cores busy in a step (after warm-up): CPU seconds / wall seconds
    cpu_phases: dict[str, float] = field(default_factory=dict)  # ... in each phase (``PHASES``)
    cpu_kernel: float = 0.0          # median share of a step's CPU seconds spent in the kernel
    cores: int = 1                   # the cores this process may use
    rss_peak: int | None = None      # the process's resident peak over the steps (and the last save)
    setup_rss: int | None = None     # ... and before them, while setup held the caller's model too
    budgets: int | None = None       # a tiered run's budgets in host memory (the device's too on a CPU)


def prepare_out(out: Path) -> Path:
    """Create the output directory and prove it is writable before any work starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"output directory {out} is not writable ({exc.strerror}); choose another --out") from None
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_vocab_and_len(model: nn.Module) -> tuple[int, int]:
    return config_vocab_and_len(model.config)


def model_flops_per_token(model: nn.Module, seq_len: int, params: int | None = None) -> int:
    """By formula for our models; 6 N + 12 L d s from the module for transformers models (``params``: N where
    the module's own registrations no longer say it, as in a pipeline's cut model)."""
    if isinstance(model.config, ModelConfig):
        return flops_per_token(model.config, seq_len)
    n = params if params is not None else sum(p.numel() for p in model.parameters())
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", 0)
    hidden = getattr(cfg, "hidden_size", 0)
    return 6 * n + 12 * layers * hidden * seq_len


class Trainer:
    """Holds the objects of one run; ``run`` is the loop."""

    def __init__(self, cfg: TrainConfig, reporter: Reporter | None = None) -> None:
        self.cfg = cfg
        self.rank, self.world = rank_from_env(), world_from_env()  # data parallel under torchrun
        self.out = prepare_out(Path(cfg.out))
        self.run_dir = RunDir(self.out)
        if self.rank == 0:  # the run's directory is rank 0's to hold; the others write only their shards
            self.run_dir.lock()  # before anything in OUT is read or written; released by run() (or by dying)
        try:
            self._start(cfg, reporter)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: TrainConfig, reporter: Reporter | None) -> None:
        if not cfg.resume and self.rank == 0:
            self.run_dir.claim_for_new_run(cfg.overwrite)
        self.device = choose_device(cfg.device)
        self.precision: Precision = choose_precision(cfg.precision, self.device)
        model_cfg = resolve_config(cfg.model)
        self.tiered = cfg.plan is not None or self.world > 1  # over several ranks, plain is DDP-like (resident)
        self.reporter = reporter if reporter is not None and self.rank == 0 else Reporter(cfg.steps, cfg.log_every,
                                                                                          quiet=True)
        self.model = self._build(model_cfg)
        vocab, max_len = model_vocab_and_len(self.model)
        if cfg.seq_len is None:  # the default, shortened for a model that takes fewer tokens
            self.cfg = cfg = dataclasses.replace(cfg, seq_len=min(SEQ_LEN, max_len))
        if cfg.seq_len > max_len:
            raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's maximum {max_len}; use a shorter --seq-len")
        self.vocab = vocab
        replica, replicas = self._replica()
        self.sampler = BatchSampler(load_tokens(cfg.data, vocab, cfg.tokenizer), cfg.batch_size, cfg.seq_len, cfg.seed,
                                    rank=replica, world=replicas)
        self.opt, self.param_names = make_adamw(self.model, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        self.state: TrainState = PlainState(self.model, self.opt, self.param_names)
        self.auto: AutoPlan | None = None
        if self.tiered:
            self._setup_tiered()
        self.scaler = self.precision.grad_scaler(tiered=self.tiered)
        # whichever keeps the fp16 loss scale: GradScaler in a plain run, the runtime's in a tiered one
        self.loss_scaler = self.opt.loss_scaler if self.tiered else (self.scaler if self.scaler.is_enabled() else None)
        self.step = 0
        self.step_seconds: list[float] = []
        self.flops_per_token = self._flops_per_token()
        if cfg.resume:
            self._resume(Path(cfg.resume))
        if self.tiered and self.rank == 0:  # only once a resume is accepted: a refused one changes nothing in OUT
            self._write_plan()
        mem = self._tier_memory()  # setup's and a resume's disk traffic are not a step's
        self.disk_watch = DiskWatch(mem, self.budgets.budgets.disk_dir) if mem and Tier.DISK in mem.pools else None
        self.cpu_watch = CpuWatch()
        self.disk_busy, self.cpu_busy = StepMedians(), StepMedians()  # "whole" step, "kernel", per phase
        self.metrics = (MetricsFile(self.out / METRICS_FILE, self.step if cfg.resume else None) if self.rank == 0
                        else NoMetrics())
        if self.metrics.dropped:
            self.reporter.message(f"metrics.jsonl: {self.metrics.dropped} line(s) that were not whole rows "
                                  "(a run killed mid-write) cut off")

    def _flops_per_token(self) -> int:
        return model_flops_per_token(self.state.module, self.cfg.seq_len)

    def _build(self, model_cfg: Any) -> nn.Module:
        """A plain run's model on its device. A tiered run's stays on the host (setup places its
        parameters in the tiers; a model bigger than the device must never go there whole), and one
        whose fp32 weights exceed the host budget, or with the budgets its memory cgroup's limit (setup
        reserves the budgets while the model still lives), is built on the meta device instead: setup
        then initialises it block by block, so it never exists whole in host memory either. Its
        initial weights are drawn per block (``init_in_place``), not as an in-memory build draws them."""
        seed_everything(self.cfg.seed)
        if not self.tiered:
            return build(model_cfg).to(self.device)
        shell = build(model_cfg, device="meta")
        weights = 4 * sum(p.numel() for p in shell.parameters())
        self.budgets = default_budgets(self.cfg, self.device)
        if self.budgets.taken:
            self.reporter.message(self.budgets.describe())
        why = meta_build_reason(weights, self.budgets.budgets, self.device)
        if why is None:
            seed_everything(self.cfg.seed)  # as a plain run draws its initial weights
            return build(model_cfg)
        self.reporter.message(f"the model's fp32 weights ({format_bytes(weights)}) {why}: building it on the meta "
                              "device; setup initialises it block by block")
        return shell

    def _setup_tiered(self) -> None:
        cfg = self.cfg
        step = None
        if cfg.plan == "auto":
            self.reporter.message("plan auto: profiling the model and solving for the budgets")
            step = ProfileStep(self.model, lm_loss, self.vocab, cfg.batch_size, cfg.seq_len,
                               self.precision.autocast, self.device)
        self.model, self.opt = setup_tiered(self.model, self.opt, cfg, self.precision, self.device,
                                            self.budgets.budgets, step)
        self.state = TieredState(self.model)
        self.auto = self.model.auto_plan
        if self.auto is not None:
            self.reporter.message(self.auto.describe())

    def describe(self) -> str:
        inner = self.state.module
        n = sum(p.numel() for p in self.model.parameters())
        if self.tiered and self.model.runtime.experts is not None and isinstance(inner.config, ModelConfig):
            n = param_count(inner.config)  # this rank holds only its experts: the model's count, not its own
        name = getattr(inner.config, "name", "") or type(inner).__name__
        tokens = self.cfg.batch_size * self.cfg.seq_len * self.cfg.grad_accum
        ranks = f" over {self.world} ranks" if self.world > 1 else ""
        return (f"training {name} ({format_count(n)} params) on {self.device.type}, {self.precision.name}; "
                f"{format_count(len(self.sampler.tokens))} tokens of data; "
                f"{tokens * self.world} tokens/step{ranks}; "
                f"steps {self.step}->{self.cfg.steps}; out {self.out}"
                + (f"; plan {self.model.runtime.plan.name} ({self.model.runtime.plan.update})" if self.tiered else ""))

    def _replica(self) -> tuple[int, int]:
        """Which data-parallel replica this rank is, of how many: each reads its own batches."""
        return self.rank, self.world

    def _write_plan(self) -> None:
        write_atomic(self.out / PLAN_FILE, self.model.runtime.plan.to_json().encode())

    def _tier_memory(self) -> Any:
        """The tiers whose disk traffic the steps' rows report (None: no tiers)."""
        return self.model.runtime.mem if self.tiered else None

    def _load(self, ckpt: Path) -> TrainerState:
        return load_checkpoint(ckpt, self.state)

    def _resume(self, path: Path) -> None:
        ckpt = find_checkpoint(path)
        state = self._load(ckpt)
        if state.step >= self.cfg.steps:
            raise ConfigError(f"checkpoint {ckpt} is already at step {state.step}, so --steps {self.cfg.steps} "
                              f"leaves nothing to do; pass --steps larger than {state.step}")
        self.step = state.step
        self.sampler.position = state.data_position
        if state.scaler and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state.scaler)
        self.reporter.message(f"resumed from {ckpt} at step {self.step}")
        for said in (batch_moved(state.run_config, state.world, self.cfg, self.world),
                     schedule_moved(state.run_config, self.cfg, self.step)):
            if said:
                self.reporter.message(said)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.sampler.position + self.sampler.rank  # the batch's number in the run's sequence
        tokens = self.sampler.next()
        x, y = masked_lm_pair(tokens, self.vocab, self.cfg.seed, k) if is_encoder(self.model) else causal_lm_pair(tokens)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad norm)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.lr, cfg.final_lr, cfg.warmup, cfg.steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        watches = [w for w in (self.cpu_watch, self.disk_watch) if w is not None]

        def phase(name: str) -> None:
            for watch in watches:
                watch.mark(name)

        for _ in range(cfg.grad_accum):
            phase(FORWARD)
            x, y = self.batch()
            with self.precision.autocast():
                loss = lm_loss(self.model, x, y) / cfg.grad_accum
            self._stop_if_not_finite("loss", loss.detach())  # before backward: overlap updates start in it
            phase(BACKWARD)
            self.scaler.scale(loss).backward()
            total += loss.detach()
        phase(STEP)
        self.scaler.unscale_(self.opt)
        norm = float("nan")
        if cfg.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
            if self.precision.name != "fp16":  # fp16 skips such a step and lowers its loss scale
                self._stop_if_not_finite("gradient norm", torch.tensor(norm))
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        phase(BETWEEN)  # the row's figures (a device sync, /proc reads) are no phase's
        return float(total), norm

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (the ranks must agree to stop at one step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        self._agreement().all_reduce(t, op="max")
        return bool(t.item())

    def _agreement(self) -> Any:
        """The host collectives over every rank of the run (the runtime's data-parallel group is all of them)."""
        return self.model.runtime.comm.host

    def _stop_if_not_finite(self, what: str, value: torch.Tensor) -> None:
        """A NaN or infinite loss (or gradient norm) ends the run before the step updates anything,
        so no checkpoint of non-finite weights is ever written. With data parallel every rank stops
        at once, whichever rank's value it was."""
        if not self._any_rank(not bool(torch.isfinite(value))):
            return
        try:
            latest = find_checkpoint(self.out) if checkpoint_root(self.out).exists() else None
        except CheckpointError:  # a damaged ``latest`` must not hide why the run stopped
            latest = None
        kept = f"the last checkpoint, {latest}, is intact" if latest else "no checkpoint was written"
        became = f"became {float(value)}" if not bool(torch.isfinite(value)) else "stopped being finite on another rank"
        raise TrainingDiverged(f"the {what} {became} at step {self.step + 1}, so the run stopped "
                               f"{self._stopped_when()}; {kept}. Lower --lr (now {self.cfg.lr:g}) or clip "
                               "with --grad-clip, then start again or --resume")

    def _stopped_when(self) -> str:
        """When in the step a non-finite loss stops the run, as ``_stop_if_not_finite`` says it."""
        return "before updating the weights"

    def save(self) -> Path:
        state = TrainerState(step=self.step, data_position=self.sampler.position,
                             scaler=self.loss_scaler.state_dict() if self.loss_scaler is not None else {},
                             run_config=self.cfg.to_dict())
        saved = self._write_checkpoint(state)
        if self.disk_watch is not None:  # what the checkpoint read from the disk tier is not the next step's traffic
            self.disk_watch.reset()
        self.cpu_watch.reset()
        return saved

    def _write_checkpoint(self, state: TrainerState) -> Path:
        return save_checkpoint(self.out, self.state, state, self.cfg.keep_checkpoints)

    def run(self) -> RunSummary:
        cfg, losses, tokens_s, tflops, start_step = self.cfg, [], [], [], self.step
        checkpoint, began, stop = None, StepTimer(self.device), StopFlag()
        self.setup_rss = restart_rss_peak()
        try:
            with stop:
                checkpoint = self._loop(stop, losses, tokens_s, tflops)
            if cfg.save and (self.step > start_step or not checkpoint_root(self.out).exists()):
                checkpoint = self.save()
            if self.reporter.output_closed:  # said where it can still be read
                print(f"tiertrain: the output was closed (its reader went away) at step {self.step}; stopped as "
                      f"on SIGTERM, checkpoint {checkpoint}; resume with tiertrain train --resume {self.out}",
                      file=sys.stderr, flush=True)
        finally:
            self.metrics.close()
            self.reporter.close()
            self.close()
        med = (lambda v: float(np.median(v)) if v else 0.0)
        return RunSummary(steps=self.step, first_loss=losses[0] if losses else float("nan"),
                          last_loss=losses[-1] if losses else float("nan"), tokens_per_s=med(tokens_s),
                          tflops=med(tflops), seconds=began.elapsed(), checkpoint=checkpoint,
                          out=self.out, losses=losses, stopped_early=self.step < cfg.steps,
                          disk_busy=self.disk_busy.median("whole"), disk_busy_phases=self.disk_busy.medians(PHASES),
                          cpu_cores=self.cpu_busy.median("whole"), cpu_kernel=self.cpu_busy.median("kernel") or 0.0,
                          cpu_phases=self.cpu_busy.medians(PHASES), cores=usable_cores(),
                          rss_peak=process_rss().get("peak") if self.setup_rss is not None else None,
                          setup_rss=self.setup_rss, budgets=self._budget_total())

    def _budget_total(self) -> int | None:
        """The budgets that are this process's resident memory: the host's, and the device's on a CPU."""
        if not self.tiered:
            return None
        b = self.budgets.budgets
        return b.host + (b.device if self.device.type == "cpu" else 0)

    def close(self) -> None:
        """Give back what the Trainer holds (its tiers, the run directory's lock); ``run`` ends with it,
        and a Trainer that will not run should call it (or be used as a context manager)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._close_tiers()
        self.run_dir.release()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_tiers(self) -> None:
        model = getattr(self, "model", None)
        runtime = getattr(model, "runtime", None) if getattr(self, "tiered", False) else None
        if runtime is not None:
            runtime.close()
            runtime.mem.close()

    def _loop(self, stop: StopFlag, losses: list[float], tokens_s: list[float], tflops: list[float]) -> Path | None:
        cfg, checkpoint = self.cfg, None
        while self.step < cfg.steps and not self._any_rank(stop.requested or self.reporter.output_closed):
            timer = StepTimer(self.device)
            loss, norm = self.train_step()
            row = self._row(loss, norm, timer.elapsed())
            self.metrics.write(row)
            self.reporter.step(row)
            losses.append(loss)
            self.step_seconds.append(row["step_s"])
            tokens_s.append(row["tokens_per_s"])
            tflops.append(row["tflops"])
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                checkpoint = self.save()
        if self.step < cfg.steps:
            self.reporter.message(f"stopping at step {self.step} as asked; " + (
                "saving a checkpoint" if cfg.save else "no checkpoint is written (--no-save)"))
        self._report_prediction()
        return checkpoint

    def _report_prediction(self) -> None:
        """The auto plan's predicted step time against the median measured after warm-up."""
        measured = self.step_seconds[WARMUP_STEPS:]
        if self.auto is None or not measured:
            return
        med, pred = float(np.median(measured)), self.auto.prediction.step_s
        self.reporter.message(f"auto plan: {'corrected ' if self.auto.corrected else ''}predicted step "
                              f"{pred * 1e3:.1f} ms, measured {med * 1e3:.1f} ms "
                              f"(median of {len(measured)} steps after warm-up, {(pred / med - 1) * 100:+.0f}%)")

    def _row(self, loss: float, norm: float, seconds: float) -> dict[str, Any]:
        tokens = self.cfg.batch_size * self.cfg.seq_len * self.cfg.grad_accum
        row = {"step": self.step, "loss": loss, "lr": self.opt.param_groups[0]["lr"], "grad_norm": norm,
               "tokens_per_s": tokens / seconds,
               # a replica's FLOPs are its ranks' together (pipeline stages, a tensor-parallel group): this rank's
               "tflops": tokens * self.flops_per_token / seconds / 1e12 / (self.world // self._replica()[1]),
               "step_s": seconds, "peak_bytes": peak_bytes(self.device), "rss_bytes": self._rss()}
        row.update(self.cpu_watch.since_last())
        if len(self.step_seconds) >= WARMUP_STEPS:  # this process's warm-up, resumed too
            cpu = row["cpu"]
            self.cpu_busy.add({"whole": cpu["cores"], "kernel": cpu["kernel"], **cpu["phases"]})
        if self.tiered:
            self._tier_figures(row)
        if self.loss_scaler is not None:
            row["loss_scale"] = self.loss_scaler.get_scale()
        return row

    def _rss(self) -> dict[str, int]:
        """RSS now and at its peak since the steps began, and setup's peak before them (``restart_rss_peak``)."""
        rss = process_rss()
        setup = getattr(self, "setup_rss", None)
        return rss if setup is None else {**rss, "setup_peak": setup}

    def _tier_figures(self, row: dict[str, Any]) -> None:
        """A tiered step's figures: each tier's page peak (what its budget bounds), the bytes the disk
        tier read and wrote during the step, the slots filled, staleness, and the auto plan's prediction."""
        stats = self.model.runtime.mem.stats()
        row["peak_bytes"] = {t: v["pages_peak_bytes"] for t, v in stats.items() if "budget" in v}
        mem = self.model.runtime.mem
        if self.disk_watch is not None:
            row.update(self.disk_watch.since_last())
            if "disk_busy" in row and len(self.step_seconds) >= WARMUP_STEPS:  # this process's warm-up, resumed too
                self.disk_busy.add({"whole": row["disk_busy"], **{n: p["busy"] for n, p in row["disk_phases"].items()}})
        total = device_peak_with_activations(stats["device"]["pages_peak_bytes"], mem.pool(Tier.DEVICE).capacity,
                                             self.device)
        if total is not None:
            row["peak_bytes"]["device_with_activations"] = total
        row["slot_fetches"] = self.model.runtime.cache.pop_fetches()  # streamed blocks copied onto the device
        staleness = self.model.runtime.pop_staleness()
        if staleness is not None:  # lockfree: the params a forward used may lag
            row["staleness"] = staleness
        if self.auto is not None and self.step == WARMUP_STEPS:  # what else runs while the measured steps do
            self._steps_load = LoadMeter().__enter__()
        if self.auto is not None and self.step > WARMUP_STEPS:  # beside the measured step_s and tier peaks
            from tiertrain.autoplan.auto_plan import CHECK_AFTER

            measured = self.step_seconds[WARMUP_STEPS:] + [row["step_s"]]
            if len(measured) == CHECK_AFTER:  # held against the first steps; remeasured where far off
                self.auto, line = self._recheck(measured, row["peak_bytes"], self._steps_load_now())
                if self.disk_watch is not None:  # a recheck may probe the disk: that is no step's busy time
                    self.disk_watch.skip_device()
                self.cpu_watch.reset()  # nor its CPU
                if line:
                    self.reporter.message(line)
            row["predicted"] = self.auto.predicted_row()

    def _steps_load_now(self) -> "Load | None":
        """What other processes took while the measured steps ran (None where it was not watched)."""
        meter = getattr(self, "_steps_load", None)
        if meter is None:
            return None
        meter.__exit__(None, None, None)
        return meter.load

    def _recheck(self, measured: list[float], peaks: dict[str, int], load: "Load | None" = None
                 ) -> tuple[AutoPlan, str]:
        """Rank 0 rechecks (it measured the profile; over several ranks the others would probe one disk
        beside it) while the others wait for it, under the measuring timeout rather than the
        collectives': a probe may take longer than a collective is allowed to."""
        from tiertrain.autoplan.auto_plan import recheck
        from tiertrain.parallel.agree import from_rank0

        auto = self.auto
        assert auto is not None
        return from_rank0("the prediction's recheck",
                          lambda: recheck(auto, measured, peaks, self.model.runtime.plan, self.model.runtime.wait_updates,
                                          load),
                          lambda _: "", lambda _: (auto, ""))


def train(cfg: TrainConfig, reporter: Reporter | None = None) -> RunSummary:
    return Trainer(cfg, reporter).run()
