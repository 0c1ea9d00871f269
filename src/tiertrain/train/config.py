"""The one typed configuration of a training run, read from YAML/JSON and overridden by flags."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiertrain import typed
from tiertrain.errors import ConfigError
from tiertrain.plan import COMPUTE_DTYPES as PRECISIONS
from tiertrain.plan import BUILTIN_PLANS, DEFAULT_MAX_STALENESS, UPDATE_MODES
from tiertrain.plan.update_modes import check_group_reads_alike, rules
from tiertrain.plan.pipeline import SCHEDULES
from tiertrain.typed import above, at_least, between, one_of

DEVICES = ("auto", "cpu", "cuda")
SEQ_LEN = 128  # tokens per sequence unless the run or the model says otherwise
# what other trainers (transformers' TrainingArguments, nanoGPT, DeepSpeed) call our options: a config
# carried over from one of them gets our name back, where spelling alone would not find it
OTHER_NAMES = {"learning_rate": "lr", "max_steps": "steps", "max_iters": "steps", "per_device_train_batch_size":
               "batch_size", "train_micro_batch_size_per_gpu": "batch_size", "micro_batch_size": "batch_size",
               "block_size": "seq_len", "max_seq_length": "seq_len", "seq_length": "seq_len",
               "gradient_accumulation_steps": "grad_accum", "max_grad_norm": "grad_clip", "gradient_clipping":
               "grad_clip", "output_dir": "out", "warmup_iters": "warmup_steps", "min_learning_rate": "min_lr"}


@dataclass
class TrainConfig:
    """Everything a run needs. Defaults train the built-in default in about a minute on 2 CPU cores.

    Every field is checked for type and range when the config is made (``typed.check``): a
    boolean is not a count, 2.7 is not a whole number, and NaN or infinite rates are refused."""

    model: Any = "gpt-small"          # a name in tiertrain.models.CONFIGS, a config file, or a mapping
    data: str = "builtin"             # "builtin", a token file (.bin/.npy), a text file or directory
    tokenizer: str | None = None      # local Hugging Face tokenizer directory for text data
    steps: int = field(default=200, metadata=at_least(1))
    batch_size: int = field(default=16, metadata=at_least(1))
    seq_len: int | None = field(default=None, metadata=at_least(1))  # default: SEQ_LEN, or the model's maximum
    grad_accum: int = field(default=1, metadata=at_least(1))
    lr: float = field(default=2e-3, metadata=above(0))
    min_lr: float | None = field(default=None, metadata=at_least(0))  # cosine floor; default lr / 10
    warmup_steps: int | None = field(default=None, metadata=at_least(0))  # default: 10% of steps, at most 100
    weight_decay: float = field(default=0.1, metadata=at_least(0))
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=between(0, 1, high_open=True))
    eps: float = field(default=1e-8, metadata=above(0))
    grad_clip: float = field(default=1.0, metadata=at_least(0))  # 0 turns clipping off
    precision: str | None = field(default=None, metadata=one_of(*PRECISIONS))  # default bf16 on CUDA, fp32 on CPU
    device: str = field(default="auto", metadata=one_of(*DEVICES))
    seed: int = field(default=0, metadata=at_least(0))
    out: str = "runs/tiertrain"
    resume: str | None = None         # a run directory or one checkpoint directory
    overwrite: bool = False           # a new run may replace the checkpoints and metrics of another in ``out``
    save_every: int = field(default=0, metadata=at_least(0))  # 0: save only at the end
    keep_checkpoints: int = field(default=2, metadata=at_least(1))
    save: bool = True                 # False: no checkpoint at all (trials, benchmarks); a stopped run is lost
    log_every: int = field(default=10, metadata=at_least(1))  # printed lines; metrics.jsonl gets every step
    plan: str | None = None           # None: plain PyTorch; resident | stream | max-offload | auto | a plan JSON file
    update: str | None = field(default=None, metadata=one_of(*UPDATE_MODES))  # None: a plan file's, else sync
    max_staleness: int | None = field(default=None, metadata=at_least(0))  # lockfree lag; None: a plan file's, else 1
    device_memory: str | None = None  # device budget with a plan, e.g. "2GiB" (default: 90% of the GPU, 4GiB on CPU)
    host_memory: str | None = None    # host budget with a plan (default: half the RAM)
    disk: str | None = None           # "DIR[:SIZE]": disk tier for a plan
    page_size: str | None = None      # memory page size, e.g. "4MiB" (default: measured for this machine)
    ep: int = field(default=1, metadata=at_least(1))  # expert parallel: ranks each MoE layer's experts are divided over
    reduce_dtype: str | None = field(default=None, metadata=one_of("fp32", "bf16"))  # gradients' sum over the ranks
    shard_group: int = field(default=0, metadata=at_least(0))  # hybrid sharding: ranks a block is split over (0: all)
    pp: int = field(default=1, metadata=at_least(1))  # pipeline stages: the ranks as ranks / pp replicas of a pipeline
    schedule: str = field(default="aiao", metadata=one_of(*SCHEDULES))  # with pp > 1; its micro-batches: grad_accum
    segments: int = field(default=1, metadata=at_least(1))  # with pp > 1: FOLD3D's segments (virtual stages per rank)
    tp: int = field(default=1, metadata=at_least(1))  # tensor parallel: each block cut over groups of tp ranks
    sequence_parallel: bool = False  # with tp > 1: each rank its slice of the sequence between the cut regions

    def __post_init__(self) -> None:
        typed.check(self, "config")
        self.validate()

    def validate(self) -> None:
        """What one field alone cannot say."""
        if self.plan is None and any((self.device_memory, self.host_memory, self.disk)):
            raise ConfigError("memory budgets apply to a plan; add --plan resident|stream|max-offload|auto|FILE")
        tiered_only = {"--update": self.update, "--max-staleness": self.max_staleness, "--page-size": self.page_size,
                       "--reduce-dtype": self.reduce_dtype, "--shard-group": self.shard_group or None}
        given = [flag for flag, value in tiered_only.items() if value is not None]
        if self.plan is None and given:  # plain PyTorch has no updates of its own to schedule, nor pages
            raise ConfigError(f"{' and '.join(given)} apply to a tiered run; add --plan "
                              "resident|stream|max-offload|auto|FILE, or leave them out for plain PyTorch")
        if self.ep > 1 and self.plan is None:
            raise ConfigError("--ep divides a mixture of experts' experts over the ranks of a tiered run; add --plan "
                              "resident|stream|max-offload|auto|FILE")
        if not self.save and self.save_every:
            raise ConfigError(f"--no-save writes no checkpoint and --save-every {self.save_every} asks for them; "
                              "give one of them")
        self._validate_pipeline()
        self._validate_tensor()
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues a run and --overwrite replaces it; give one of them")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ConfigError(f"min_lr {self.min_lr} is above lr {self.lr}; give min_lr <= lr")

    def _validate_pipeline(self) -> None:
        if self.pp == 1:  # a schedule or segments saved by a pipelined run stay in its options when it resumes at 1
            return
        if self.plan is None:
            raise ConfigError(f"--pp {self.pp} tiers each stage: add --plan resident|stream|max-offload|FILE")
        if self.precision == "fp16":
            raise ConfigError("pipeline stages train in fp32 or bf16, not fp16 (its loss scale is not agreed over the "
                              "stages): use --precision bf16")
        if self.update is not None and rules(self.update).loops:
            raise ConfigError(f"train --pp takes --update sync or overlap, not {self.update}: a stage's update loop "
                              "would let the stages read params of different ages")
        if self.update is not None and rules(self.update).updates_as_final and self.grad_clip > 0:
            raise ConfigError(f"train --pp --update {self.update} updates each block as its gradients come, before "
                              "the norm over every stage is known: add --grad-clip 0, or use --update sync to clip")

    def _validate_tensor(self) -> None:
        if self.tp == 1:  # a sequence-parallel run's option stays in its saved options when it resumes at 1
            return
        if self.plan is None or self.plan == "auto":
            raise ConfigError(f"--tp {self.tp} tiers each rank's shards under a named plan: add --plan "
                              "resident|stream|max-offload|FILE (not auto yet)")
        if self.precision == "fp16":
            raise ConfigError("tensor-parallel runs train in fp32 or bf16, not fp16: use --precision bf16")
        if self.update is not None and not (self.max_staleness is None and self.plan not in BUILTIN_PLANS):
            # (a plan file's own max staleness is checked with the file, before torchrun starts)
            check_group_reads_alike(self.update, DEFAULT_MAX_STALENESS if self.max_staleness is None else
                                    self.max_staleness)

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def warmup(self) -> int:
        return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a mapping; refuse anything else clearly."""
    path = Path(path)
    text = typed.read_text(path, "config file", "check the path given to --config (a YAML or JSON file)")
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
                close = [OTHER_NAMES[name]] if name in OTHER_NAMES else difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown option {key!r}{hint}; valid options: {', '.join(known)}")
            if value is not None:
                merged[name] = value
    try:
        return TrainConfig(**merged)
    except TypeError as exc:
        raise ConfigError(f"config value has the wrong type: {exc}") from None
