"""What a checkpoint saves and restores, for a plain run and for a tiered one.

Both speak the same names: ``model.state_dict()`` keys for weights and
``<param name>::<state>`` for AdamW state, so checkpoints move between the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn as nn

from tiertrain.errors import CheckpointError
from tiertrain.tensor_file import TensorStream


class TrainState(Protocol):
    module: nn.Module  # the user's model (for its config)

    def weights(self) -> TensorStream: ...
    def optimizer_tensors(self) -> TensorStream: ...
    def group_hparams(self) -> list[dict[str, Any]]: ...
    def expected_weights(self) -> dict[str, torch.Size]: ...
    def load(self, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor],
             groups: list[dict[str, Any]]) -> None: ...


def weights_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without aliases: tied weights are stored once (safetensors refuses shared storage)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def _plain_hparams(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"} for g in groups]


def _check_groups(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> None:
    if len(saved) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run {len(current)}")


class PlainState:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.module, self.opt, self.names = model, opt, names

    def weights(self) -> TensorStream:
        return TensorStream.of(weights_to_save(self.module))

    def expected_weights(self) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in weights_to_save(self.module).items()}

    def optimizer_tensors(self) -> TensorStream:
        return TensorStream.of({f"{self.names[idx]}::{key}": torch.as_tensor(value).detach().contiguous().cpu()
                                for idx, state in self.opt.state_dict()["state"].items() for key, value in state.items()})

    def group_hparams(self) -> list[dict[str, Any]]:
        return _plain_hparams(self.opt.state_dict()["param_groups"])

    def load(self, weights, optim, groups) -> None:
        self.module.load_state_dict(dict(weights.items()), strict=False)
        sd = self.opt.state_dict()
        index = {name: idx for idx, name in self.names.items()}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in optim.items():
            name, _, kind = key.partition("::")
            if name not in index:
                raise CheckpointError(f"the checkpoint's optimizer state names parameter {name!r} that this model lacks")
            state.setdefault(index[name], {})[kind] = value
        _check_groups(groups, sd["param_groups"])
        for group, saved in zip(sd["param_groups"], groups):
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in group})
        sd["state"] = state
        self.opt.load_state_dict(sd)


class TieredState:
    """A run under ``tiertrain.setup``: weights and moments live in the memory tiers."""

    def __init__(self, tiered_model: nn.Module) -> None:
        self.rt = tiered_model.runtime
        self.module = tiered_model.module

    def weights(self) -> TensorStream:
        from tiertrain.runtime.state_io import weight_stream

        return weight_stream(self.rt)

    def expected_weights(self) -> dict[str, torch.Size]:
        return {n: p.shape for st in self.rt.states for n, p in st.block.params}

    def optimizer_tensors(self) -> TensorStream:
        from tiertrain.runtime.state_io import optimizer_stream

        return optimizer_stream(self.rt)

    def group_hparams(self) -> list[dict[str, Any]]:
        return _plain_hparams(self.rt.groups)

    def load(self, weights, optim, groups) -> None:
        from tiertrain.runtime.state_io import import_state

        _check_groups(groups, self.rt.groups)
        for group, saved in zip(self.rt.groups, groups):
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in group})
        import_state(self.rt, weights, optim)
