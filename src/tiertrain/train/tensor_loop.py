"""``tiertrain train --nproc N --tp T``: the training loop over a model whose blocks are cut over groups of
T ranks (``tiertrain.tensor_parallel``).

The same run as ``Trainer``'s (run directory, data, schedule, metrics, stop on a signal, nothing lost)
with each rank's shards where one runtime held the model: every rank of a tensor-parallel group reads its
replica's batches (N / T replicas), the gradient norm spans every shard, and checkpoints are
tensor-parallel ones (``checkpoint.tensor_parallel``): they resume at another tp, or in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiertrain.checkpoint.run import TrainerState
from tiertrain.checkpoint.tensor_parallel import save_shards
from tiertrain.checkpoint.train_state import TieredState
from tiertrain.models import ModelConfig, param_count
from tiertrain.train.loop import Trainer, model_flops_per_token
from tiertrain.units import format_count, parse_size


class TensorTrainer(Trainer):
    def _replica(self) -> tuple[int, int]:
        return self.rank // self.cfg.tp, self.world // self.cfg.tp

    def _setup_tiered(self) -> None:
        from tiertrain.api.tensor_parallel import tensor_parallel

        cfg = self.cfg  # its plan checked by TrainConfig (a named one or a file, not auto)
        self.whole_params = sum(p.numel() for p in self.model.parameters())  # before the cut
        self.tensor = tensor_parallel(self.model, self.opt, cfg.tp, self.budgets.budgets, plan=cfg.plan,
                                      page_size=parse_size(cfg.page_size) if cfg.page_size else None,
                                      grad_accum=cfg.grad_accum, update=cfg.update, max_staleness=cfg.max_staleness,
                                      max_grad_norm=cfg.grad_clip or None, reduce_dtype=cfg.reduce_dtype,
                                      compute_dtype=self.precision.name, init_states=not cfg.resume,
                                      sequence_parallel=cfg.sequence_parallel, ep=cfg.ep if cfg.ep > 1 else None,
                                      shard_group=cfg.shard_group or None)
        self.model, self.opt = self.tensor.model, self.tensor.optimizer
        self.state = TieredState(self.model)

    def _flops_per_token(self) -> int:
        return model_flops_per_token(self.model, self.cfg.seq_len, self.whole_params)

    def _agreement(self) -> Any:
        return self.tensor.mesh.world.host  # a shard's data-parallel group is not every rank

    def _write_checkpoint(self, state: TrainerState) -> Path:
        return save_shards(self.out, self.model, self.tensor.mesh, self.opt.param_groups, state,
                           self.cfg.keep_checkpoints)

    def _close_tiers(self) -> None:
        tensor = getattr(self, "tensor", None)
        if tensor is not None:
            tensor.close()
        else:
            super()._close_tiers()

    def describe(self) -> str:
        cfg, model_cfg = self.cfg, self.model.config
        n = param_count(model_cfg) if isinstance(model_cfg, ModelConfig) else self.whole_params
        tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum * (self.world // cfg.tp)
        name = getattr(model_cfg, "name", "") or type(self.model).__name__
        return (f"training {name} ({format_count(n)} params) on {self.device.type}, "
                f"{self.precision.name}; tensor parallel over {cfg.tp} ranks x {self.world // cfg.tp} replicas"
                f"{', sequence parallel' if cfg.sequence_parallel else ''}; "
                f"{tokens} tokens/step; steps {self.step}->{cfg.steps}; out {self.out}; plan {self.model.runtime.plan.name}")
