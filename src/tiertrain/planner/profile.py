"""What the planner plans from: per-block times and sizes, and the machine's speeds.

A profile is a JSON file, so plans can be made offline, on another machine, or from
synthetic numbers (the tests reproduce H3T's case study that way). The planner imports
nothing from the runtime: a profile is all it knows of the model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tiertrain.errors import ConfigError


@dataclass(frozen=True)
class BlockProfile:
    name: str
    forward_s: float             # one forward of the block
    backward_s: float            # its backward, without recompute
    params: int                  # parameter count
    act_bytes: int               # everything autograd saves inside the block
    hidden_bytes: int            # the block's input: all that recompute keeps
    recompute_s: float | None = None  # the forward again inside backward (None: as long as forward_s)

    @property
    def recompute_seconds(self) -> float:
        return self.forward_s if self.recompute_s is None else self.recompute_s

    def param_bytes(self, dtype_bytes: int) -> int:
        return self.params * dtype_bytes


@dataclass(frozen=True)
class MachineProfile:
    h2d_bps: float               # host -> device bytes/s (pinned)
    d2h_bps: float
    disk_read_bps: float
    disk_write_bps: float
    adam_params_per_s: float     # CPU AdamW throughput on the update workers
    device_is_host: bool = False  # CPU-only: "device" memory is host RAM, copies are memcpy
    disk_cpu_s_per_byte: float = 0.0  # CPU time the disk tier spends per byte (syscalls, checksums)


@dataclass(frozen=True)
class Profile:
    blocks: tuple[BlockProfile, ...]   # the repeated blocks, in forward order
    rest: BlockProfile                 # embeddings, head, final norm
    machine: MachineProfile
    compute_bytes: int = 4             # bytes per compute param (fp32 4, bf16/fp16 2)
    key: str = ""                      # machine + model + batch shape it was measured for
    page: int = 0                      # the runtime's page size: chunks take whole pages (0: unpaged)
    order: tuple[int, ...] = ()        # blocks in the order one forward called them (measured profiles)
    grad_copies: int = 1               # the run's gradient chunks per block at once (plan_bytes.grad_copies)
    disk_passes: float = 1.0           # a disk-homed block's update passes per step (plan_bytes.disk_passes_per_step)
    transient_grads: bool = False      # overlap without clipping or accumulation: few grad chunks at once
    read_ahead: int = 2                # the plan's disk-homed blocks read in ahead (Plan.read_ahead)
    update_workers: int = 2            # the plan's optimizer threads, each holding a block's states (Plan.update_workers)

    @property
    def acts_on_device(self) -> bool:
        """Whether saved activations take device-tier memory (not on CPU, where the tier is a pool
        of params and states and torch allocates activations outside it)."""
        return not self.machine.device_is_host

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        try:
            d = json.loads(text)
            return cls(blocks=tuple(BlockProfile(**b) for b in d["blocks"]), rest=BlockProfile(**d["rest"]),
                       machine=MachineProfile(**d["machine"]), compute_bytes=int(d.get("compute_bytes", 4)),
                       key=d.get("key", ""), page=int(d.get("page", 0)),
                       order=tuple(int(i) for i in d.get("order", ())), grad_copies=int(d.get("grad_copies", 1)),
                       disk_passes=float(d.get("disk_passes", 1.0)),
                       transient_grads=bool(d.get("transient_grads", False)), read_ahead=int(d.get("read_ahead", 2)),
                       update_workers=int(d.get("update_workers", 2)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"not a tiertrain profile: {exc}") from None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Profile":
        if not path.is_file():
            raise ConfigError(f"profile {path} does not exist; run `tiertrain plan` without --profile to measure one")
        return cls.from_json(path.read_text())
