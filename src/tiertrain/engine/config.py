"""The one typed configuration of a training run, read from YAML/JSON and overridden by flags."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from tiertrain.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    """Everything a run needs. Defaults train the built-in default in about a minute on 2 CPU cores."""

    model: Any = "gpt-small"          # a name in tiertrain.models.CONFIGS, a config file, or a mapping
    data: str = "builtin"             # "builtin", a token file (.bin/.npy), a text file or directory
    tokenizer: str | None = None      # local Hugging Face tokenizer directory for text data
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr: float | None = None       # cosine floor; default lr / 10
    warmup_steps: int | None = None   # default: 10% of steps, at most 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0            # 0 turns clipping off
    precision: str | None = None      # fp32 | bf16 | fp16; default bf16 on CUDA, fp32 on CPU
    device: str = "auto"
    seed: int = 0
    out: str = "runs/tiertrain"
    resume: str | None = None         # a run directory or one checkpoint directory
    save_every: int = 0               # 0: save only at the end
    keep_checkpoints: int = 2
    log_every: int = 10               # printed lines; metrics.jsonl gets every step
    plan: str | None = None           # None: plain PyTorch; resident | stream | max-offload | auto | a plan JSON file
    update: str | None = None         # sync | overlap | lockfree (with a plan); None: a plan file's, else sync
    max_staleness: int | None = None  # lockfree: steps a block's params may lag; None: a plan file's, else 1
    device_memory: str | None = None  # device budget with a plan, e.g. "2GiB" (default: 90% of the GPU, 4GiB on CPU)
    host_memory: str | None = None    # host budget with a plan (default: half the RAM)
    disk: str | None = None           # "DIR[:SIZE]": disk tier for a plan
    page_size: str | None = None      # memory page size, e.g. "4MiB" (default: measured for this machine)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "keep_checkpoints", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive whole number, got {getattr(self, name)!r}")
        for name in ("save_every", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.update not in (None, "sync", "overlap", "lockfree"):
            raise ConfigError(f"update {self.update!r} is not one of sync, overlap, lockfree")
        if self.plan is None and any((self.device_memory, self.host_memory, self.disk)):
            raise ConfigError("memory budgets apply to a plan; add --plan resident|stream|max-offload|auto|FILE")
        if self.device not in DEVICES:
            raise ConfigError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        self.betas = tuple(self.betas)  # YAML/JSON give lists
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("extra")
        data["betas"] = list(self.betas)
        return data


def _fields() -> dict[str, Any]:
    hints = get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if f.name != "extra"}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a mapping; refuse anything else clearly."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; check the path given to --config")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is malformed (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                          "fix the syntax") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown place"
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"config file {path} is malformed ({where}: {problem}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value, not {type(data).__name__}")
    return data


def make_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> TrainConfig:
    """Merge a config file's values with flags (flags win); refuse unknown keys by name."""
    known = _fields()
    merged: dict[str, Any] = {}
    for source in (file_values, overrides):
        for key, value in source.items():
            name = key.replace("-", "_")
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown option {key!r}{hint}; valid options: {', '.join(known)}")
            if value is not None:
                merged[name] = value
    try:
        return TrainConfig(**merged)
    except TypeError as exc:
        raise ConfigError(f"config value has the wrong type: {exc}") from None
