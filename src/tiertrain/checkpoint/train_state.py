"""What a checkpoint saves and restores, for a plain run and for a tiered one.

Both speak the same names: ``model.state_dict()`` keys for weights and
``<param name>::<state>`` for AdamW state, so checkpoints move between the two.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any, Protocol

import torch
import torch.nn as nn

from tiertrain import typed
from tiertrain.errors import CheckpointError
from tiertrain.optim.hparams import KEYS, AdamWHyper
from tiertrain.tensor_file import TensorSpec, TensorStream

F32 = torch.float32


class TrainState(Protocol):
    module: nn.Module  # the user's model (for its config)

    def weights(self) -> TensorStream: ...
    def optimizer_tensors(self) -> TensorStream: ...
    def group_hparams(self) -> list[dict[str, Any]]: ...
    def expected_weights(self) -> dict[str, TensorSpec]: ...
    def expected_moments(self) -> dict[str, TensorSpec]: ...
    def load(self, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor],
             groups: list[dict[str, Any]]) -> None: ...


def _unaliased(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's entries without aliases: tied weights appear once."""
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        yield name, t


def weights_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without aliases: tied weights are stored once (safetensors refuses shared storage)."""
    return {name: t.detach().contiguous().cpu() for name, t in _unaliased(model)}


def plain_hparams(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"} for g in groups]


def checked_groups(saved: Any, current: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The saved parameter groups' hyperparameters, each checked for type and range, one per group
    of this run; refused with one ``CheckpointError`` before anything is loaded."""
    if not isinstance(saved, list) or len(saved) != len(current):
        count = len(saved) if isinstance(saved, list) else "no list of"
        raise CheckpointError(f"{where}: the optimizer has {count} parameter groups, this run {len(current)}; "
                              "resume the run it was saved from")
    groups = []
    for i, group in enumerate(saved):
        if not isinstance(group, Mapping):
            raise CheckpointError(f"{where}: param_groups[{i}] must be a mapping; resume from another checkpoint")
        try:
            hp = typed.load(AdamWHyper, {k: group[k] for k in KEYS if k in group}, f"{where}: param_groups[{i}]",
                            error=CheckpointError)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; resume from another checkpoint") from None
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(hp).items()})
    return groups


def _merge_groups(targets: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Set each group's AdamW hyperparameters from the checkpoint (lists back to tuples); only those."""
    if len(saved) != len(targets):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run {len(targets)}; "
                              "resume the run it was saved from")
    for group, values in zip(targets, saved):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()
                      if k in KEYS and k in group})


class PlainState:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.module, self.opt, self.names = model, opt, names

    def weights(self) -> TensorStream:
        return TensorStream.of(weights_to_save(self.module))

    def expected_weights(self) -> dict[str, TensorSpec]:
        """What model.safetensors must hold, from the tensors' metadata (nothing is copied)."""
        return {k: TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in _unaliased(self.module)}

    def expected_moments(self) -> dict[str, TensorSpec]:
        """Per parameter name, the dtype and shape its AdamW moments have (torch keeps them in the
        parameter's)."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        return {name: TensorSpec(name, params[idx].dtype, tuple(params[idx].shape)) for idx, name in self.names.items()}

    def optimizer_tensors(self) -> TensorStream:
        return TensorStream.of({f"{self.names[idx]}::{key}": torch.as_tensor(value).detach().contiguous().cpu()
                                for idx, state in self.opt.state_dict()["state"].items() for key, value in state.items()})

    def group_hparams(self) -> list[dict[str, Any]]:
        return plain_hparams(self.opt.state_dict()["param_groups"])

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
        _merge_groups(sd["param_groups"], groups)
        sd["state"] = state
        self.opt.load_state_dict(sd)


class TieredState:
    """A run under ``tiertrain.setup``: weights and moments live in the memory tiers."""

    def __init__(self, tiered_model: nn.Module) -> None:
        self.rt = tiered_model.runtime
        self.module = tiered_model  # tiered in place: the user's model itself

    @property
    def expert_parallel(self) -> bool:
        """Whether this rank holds only some of each mixture-of-experts layer's experts."""
        return self.rt.experts is not None

    def weights(self) -> TensorStream:
        from tiertrain.runtime.state_io import weight_stream

        return weight_stream(self.rt)

    def expected_weights(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(n, F32, tuple(p.shape)) for st in self.rt.groups for n, p in st.block.params}

    def expected_moments(self) -> dict[str, TensorSpec]:
        return self.expected_weights()  # fp32 moments beside each fp32 master

    def optimizer_tensors(self) -> TensorStream:
        from tiertrain.runtime.state_io import optimizer_stream

        return optimizer_stream(self.rt)

    def group_hparams(self) -> list[dict[str, Any]]:
        return plain_hparams(self.rt.param_groups)

    def load(self, weights, optim, groups) -> None:
        from tiertrain.runtime.state_io import import_state

        _merge_groups(self.rt.param_groups, groups)
        import_state(self.rt, weights, optim)
