"""``tiertrain train --nproc N --pp P [--tp T]``: the training loop over a pipelined model (``tiertrain.pipeline``),
each stage's blocks cut over T ranks where ``--tp`` is given (dp x pp x tp).

The same run as ``Trainer``'s (run directory, data, schedule, metrics, stop on a signal, nothing lost)
with a pipeline where one runtime was: each rank builds the model as a tiered run does (on the meta device
where its fp32 weights exceed the budgets: then each rank's stages are drawn where they live, and a model
larger than one host's memory is cut into stages), keeps its stages, and every rank of a pipeline reads its
replica's batches (the first stage uses the token ids, the last the targets). A step
is ``--grad-accum`` micro-batches (the pipeline's M) through the schedule, the gradient norm clipped over
every stage, each stage's update, and the rows and checkpoints every rank agrees on. Checkpoints are
pipelined ones (``checkpoint.pipelined``): they resume at another layout, or in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiertrain.checkpoint.pipelined import PipelineRecord, load_pipeline, save_pipelined
from tiertrain.checkpoint.run import TrainerState
from tiertrain.errors import ConfigError
from tiertrain.models import ModelConfig, param_count
from tiertrain.plan.pipeline import PipelineLayout
from tiertrain.plan.update_modes import rules
from tiertrain.train.config import TrainConfig
from tiertrain.train.disk_watch import BETWEEN, FORWARD, STEP
from tiertrain.train.loop import Trainer, model_flops_per_token
from tiertrain.train.metrics import Reporter
from tiertrain.train.schedule import lr_at
from tiertrain.units import format_count, parse_size


def trainer_for(cfg: TrainConfig, reporter: Reporter | None = None) -> Trainer:
    """The loop for ``cfg``: over a pipeline where ``--pp`` is above 1 (its stages' blocks cut over groups
    where ``--tp`` is too), over tensor-parallel groups where ``--tp`` alone is."""
    if cfg.pp > 1:
        return PipelineTrainer(cfg, reporter)
    if cfg.tp > 1:
        from tiertrain.train.tensor_loop import TensorTrainer

        return TensorTrainer(cfg, reporter)
    return Trainer(cfg, reporter)


class _PipelineState:
    """What ``Trainer`` reads of a run's state between steps: the model (its config, its FLOPs)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


class PipelineTrainer(Trainer):
    def _replica(self) -> tuple[int, int]:
        ranks = self.cfg.pp * self.cfg.tp  # a replica: a pipeline of stages, each over a tensor-parallel group
        return self.rank // ranks, self.world // ranks

    def _setup_tiered(self) -> None:
        from tiertrain.api.pipeline import pipeline

        cfg = self.cfg
        if cfg.plan == "auto":  # `tiertrain train --nproc N` plans the stages before it starts the ranks
            raise ConfigError("--plan auto for a pipeline is planned by tiertrain train --nproc N before the ranks "
                              f"start; under your own torchrun plan the stages with tiertrain plan --nproc N --pp "
                              f"{cfg.pp} --out plan.json and pass --plan plan.json")
        self.layout = PipelineLayout(cfg.pp, cfg.schedule, cfg.grad_accum, cfg.segments)
        self.whole_params = sum(p.numel() for p in self.model.parameters())  # before the cut re-registers a tie
        self.pipe = pipeline(self.model, self.opt, self.layout, self.budgets.budgets, plan=cfg.plan,
                             page_size=parse_size(cfg.page_size) if cfg.page_size else None,
                             update=cfg.update or "sync",
                             max_grad_norm=cfg.grad_clip or None, reduce_dtype=cfg.reduce_dtype or "fp32",
                             compute_dtype=self.precision.name, tp=cfg.tp, shard_group=cfg.shard_group or None,
                             ep=cfg.ep if cfg.ep > 1 else None,
                             sequence_parallel=cfg.sequence_parallel and cfg.tp > 1)  # (a resume at tp 1 keeps it)
        self.opt = self.pipe.optimizer
        self.state = _PipelineState(self.model)  # type: ignore[assignment]

    def _flops_per_token(self) -> int:
        return model_flops_per_token(self.model, self.cfg.seq_len, self.whole_params)

    def _write_plan(self) -> None:
        return None  # each stage has its plan; plan.json describes one runtime's

    def _tier_memory(self) -> Any:
        return None  # the steps' rows give each of this rank's stages' page peaks, not their disk traffic

    def _load(self, ckpt: Path) -> TrainerState:
        return load_pipeline(self.pipe, ckpt)

    def save(self) -> Path:
        state = TrainerState(step=self.step, data_position=self.sampler.position, scaler={},
                             run_config=self.cfg.to_dict())
        record = PipelineRecord(self.layout.pp, self.layout.stages, self.world)
        saved = save_pipelined(self.out, list(zip(self.pipe.indices, self.pipe.stages)), self.pipe.mesh.world,
                               record, self.opt.param_groups, state, self.cfg.keep_checkpoints)
        self.cpu_watch.reset()
        return saved

    def train_step(self) -> tuple[float, float]:
        """The step's micro-batches through the schedule as one batch, clipped over every stage, updated."""
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg.lr, cfg.final_lr, cfg.warmup, cfg.steps)
        self.cpu_watch.mark(FORWARD)  # forward and backward interleave in a schedule: one phase
        pairs = [self.batch() for _ in range(cfg.grad_accum)]
        self.pipe.step(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))
        loss = torch.zeros(())
        for micro in self.pipe.micro_losses:  # summed as Trainer sums its micro-batches' (fp32, in order)
            loss += micro
        self._stop_if_not_finite("loss", loss)
        self.cpu_watch.mark(STEP)
        norm = float("nan")
        if cfg.grad_clip > 0:
            norm = float(self.opt.clip_grad_norm_(cfg.grad_clip))
            self._stop_if_not_finite("gradient norm", torch.tensor(norm))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.cpu_watch.mark(BETWEEN)
        return float(loss), norm

    def _stopped_when(self) -> str:
        if rules(self.cfg.update or "sync").updates_as_final:  # the loss is known only after the schedule's backward
            return "after backward had updated some blocks (--update overlap; nothing of this step is saved)"
        return super()._stopped_when()

    def _agreement(self) -> Any:
        return self.pipe.mesh.world.host  # a stage's data-parallel group is not every rank

    def _tier_figures(self, row: dict[str, Any]) -> None:
        """Each tier's page peak on the busiest rank (every rank computes its row: rank 0's stages alone
        would leave out the last stage's head)."""
        tiers = ("device", "host", "disk")
        mine = torch.full((len(tiers),), -1.0, dtype=torch.float64)  # -1: no such tier on this rank
        for stage in self.pipe.stages:  # this rank's stages' pools: page peaks add up
            for tier, v in stage.runtime.mem.stats().items():
                if "budget" in v:
                    mine[tiers.index(tier)] = max(0.0, float(mine[tiers.index(tier)])) + v["pages_peak_bytes"]
        self.pipe.mesh.world.host.all_reduce(mine, op="max")
        row["peak_bytes"] = {t: int(mine[i]) for i, t in enumerate(tiers) if mine[i] >= 0}

    def _close_tiers(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()

    def describe(self) -> str:
        cfg, model_cfg = self.cfg, self.model.config
        name = getattr(model_cfg, "name", "") or type(self.model).__name__
        # the whole model's count (counted before the cut; the others' parameters keep their shapes on meta)
        n = param_count(model_cfg) if isinstance(model_cfg, ModelConfig) else self.whole_params
        replicas = self._replica()[1]
        tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum * replicas
        cut = (f", each stage over {cfg.tp} tensor-parallel ranks"
               f"{' (sequence parallel)' if cfg.sequence_parallel else ''}" if cfg.tp > 1 else "")
        return (f"training {name} ({format_count(n)} params) on {self.device.type}, "
                f"{self.precision.name}; pipeline of {cfg.pp} ranks{cut} x {replicas} replicas, {cfg.schedule}, "
                f"{cfg.grad_accum} micro-batches, {self.layout.stages} stages; {tokens} tokens/step; "
                f"steps {self.step}->{cfg.steps}; out {self.out}")
