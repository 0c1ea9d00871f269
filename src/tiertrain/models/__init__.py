"""Reference models and the one entry point that builds any model tiertrain trains."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError, one_line
from tiertrain.models.accounting import flops_per_token, param_count, state_bytes
from tiertrain.models.config import ModelConfig
from tiertrain.models.configs import CONFIGS, DEFAULT_MODEL
from tiertrain.models.gpt import GPT

__all__ = ["CONFIGS", "DEFAULT_MODEL", "GPT", "ModelConfig", "build", "config_blocks", "config_vocab_and_len", "resolve_config",
           "flops_per_token", "param_count", "state_bytes"]


def config_blocks(cfg: Any) -> int | None:
    """The repeated blocks a model config names (ours, or a transformers one's), if it names them."""
    return getattr(cfg, "n_layer", None) or getattr(cfg, "num_hidden_layers", None)


def config_vocab_and_len(cfg: Any) -> tuple[int, int]:
    """A model config's vocabulary and longest sequence (ours, or a transformers one's)."""
    if isinstance(cfg, ModelConfig):
        return cfg.vocab_size, cfg.max_seq_len
    return cfg.vocab_size, getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 1 << 30)


def resolve_config(spec: Any) -> Any:
    """Turn a name, dict, file path or config object into a ModelConfig or a transformers config.

    A JSON file with a ``model_type`` key is a Hugging Face config (built with
    ``AutoModelForCausalLM.from_config``; nothing is fetched from a hub).
    """
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, dict):
        if "model_type" in spec:
            return _hf_config(spec)
        return ModelConfig.from_dict(spec)
    if isinstance(spec, str):
        if spec.lower() in CONFIGS:
            return CONFIGS[spec.lower()]
        path = Path(spec)
        if path.suffix in (".json", ".yaml", ".yml") or path.is_dir():
            return resolve_config(_read_model_file(path))
        close = difflib.get_close_matches(spec.lower(), CONFIGS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"unknown model {spec!r}; {hint}use one of: {', '.join(CONFIGS)}, "
            "or a path to a model config JSON (ours or a Hugging Face config.json)"
        )
    if type(spec).__module__.startswith("transformers"):
        return spec
    raise ConfigError(f"cannot build a model from {type(spec).__name__}; give a name or a config")


def _read_model_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model config file {path} does not exist; give a model name or an existing file")
    import yaml

    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read model config {path} ({one_line(exc)}); fix its syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path} must hold a mapping of fields")
    return data


def _hf_config(data: dict[str, Any]) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(
            "this model config is a Hugging Face config; install the extra: pip install 'tiertrain[hf]'"
        ) from None
    data = dict(data)
    try:
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except Exception as exc:  # noqa: BLE001 - transformers validates configs with several error types of its own
        raise ConfigError(f"Hugging Face config not usable: {one_line(exc)}; fix the config's values") from None



def build(spec: Any, device: torch.device | str | None = None) -> nn.Module:
    """Build a model from a name in CONFIGS, a ModelConfig, a dict, a file, or a transformers config.

    Use ``device="meta"`` to build a model of any size without allocating memory.
    """
    cfg = resolve_config(spec)
    with torch.device(device or "cpu"):
        if isinstance(cfg, ModelConfig):
            return GPT(cfg)
        return _build_hf(cfg)


def _build_hf(cfg: Any) -> nn.Module:
    """transformers checks few of a config's values until it builds the model (heads that do not
    divide the width, a width given as text): what the build raises is the config's fault."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # noqa: BLE001 - whatever the build raises, the config's values caused it
        raise ConfigError(f"the transformers config ({getattr(cfg, 'model_type', '?')}) does not build a model: "
                          f"{one_line(exc)}; fix the config's values") from None
