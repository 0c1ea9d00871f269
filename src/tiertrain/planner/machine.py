"""A machine, described by its sizes and speeds: what the planner needs to plan for hardware you do
not have (a datasheet, ``planner.datasheets``) or the one you are on (``tiertrain probe`` measures it).

A description is plain data, written and read as JSON through the typed loader, so a file from a
colleague, or a datasheet edited by hand, is checked field by field. The planner never measures: it
takes a description's rates (``rates``) for links, disk and the CPU optimizer, and its compute rates
to carry block times measured on one machine over to another (``planner.retarget``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tiertrain import typed
from tiertrain.errors import ConfigError
from tiertrain.plan.budgets import Budgets
from tiertrain.planner.profile import MachineProfile
from tiertrain.typed import above, at_least, one_of

_RATE = above(0)
_SIZE = at_least(0)


@dataclass(frozen=True)
class PerDtype:
    """FLOP/s per compute precision (0: unknown or unsupported)."""

    fp32: float = field(metadata=_SIZE)
    bf16: float = field(metadata=_SIZE)
    fp16: float = field(metadata=_SIZE)

    def of(self, dtype: str) -> float:
        return {"fp32": self.fp32, "bf16": self.bf16, "fp16": self.fp16}[dtype]


@dataclass(frozen=True)
class Link:
    """A network link of the machine: its name and bytes/s each way (``plan --nproc`` plans collectives at the first's)."""

    name: str
    bps: float = field(metadata=_RATE)


@dataclass(frozen=True)
class Load:
    """What else ran while a probe measured: a probe taken on a busy machine reads its rates low,
    and must not be kept for later runs (``engine.measure.machine``)."""

    others_cores: float = field(metadata=_SIZE)  # cores used by other processes and the hypervisor's steal
    cores: int = field(metadata=at_least(1))     # cores this process may run on
    loadavg: float = field(default=0.0, metadata=_SIZE)  # the 1-minute load average when it ended

    @property
    def busy(self) -> bool:
        """Others took a quarter of the cores or more (half a core on two)."""
        return self.others_cores >= max(0.25 * self.cores, 0.3)


@dataclass(frozen=True)
class Machine:
    """One compute device with its host: memory per tier and the rate of everything a step does."""

    name: str
    device: str = field(metadata=one_of("cuda", "cpu"))  # cpu: the device tier is host RAM, copies memcpy
    device_memory: int = field(metadata=_SIZE)    # bytes of the compute device (on cpu: the RAM it shares)
    host_memory: int = field(metadata=_SIZE)      # bytes of host RAM for this device
    peak_flops: PerDtype                          # datasheet dense peak (0: unknown, as for a probed CPU)
    matmul_flops: PerDtype                        # achieved on a large matrix product (measured, or assumed)
    memory_bps: float = field(metadata=_RATE)     # device memory bandwidth, bytes read + written per second
    h2d_bps: float = field(metadata=_RATE)        # host -> device copies, pinned
    d2h_bps: float = field(metadata=_RATE)
    disk_read_bps: float = field(metadata=_RATE)
    disk_write_bps: float = field(metadata=_RATE)
    adam_params_per_s: float = field(metadata=_RATE)  # CPU AdamW on the update workers
    disk_bytes: int = field(default=0, metadata=_SIZE)  # local disk for the disk tier
    disk_cpu_s_per_byte: float = field(default=0.0, metadata=_SIZE)  # CPU time the disk tier spends per byte
    page_size: int = field(default=0, metadata=_SIZE)  # the page size runs use here (0: measure it)
    # reads and writes at once against in turns on the disk tier, at that page size (`tiertrain probe`
    # measures it: ``engine.measure.machine.with_disk_gain``; 1: they take turns, as datasheets are planned)
    disk_together_gain: float = field(default=1.0, metadata=at_least(1))
    network: tuple[Link, ...] = ()                # per link; plan --nproc takes the first for every collective
    source: str = ""                              # where the figures come from
    load: Load | None = None                      # a probe's: what else ran while it measured

    @property
    def device_is_host(self) -> bool:
        return self.device == "cpu"

    def rates(self) -> MachineProfile:
        """What the simulator and the solvers read."""
        return MachineProfile(self.h2d_bps, self.d2h_bps, self.disk_read_bps, self.disk_write_bps,
                              self.adam_params_per_s, device_is_host=self.device_is_host,
                              disk_cpu_s_per_byte=self.disk_cpu_s_per_byte,
                              disk_together_gain=self.disk_together_gain)

    def budgets(self) -> Budgets:
        """The budgets a run on this machine gets where none are given: on a GPU 90% of its memory
        (as ``train`` takes), 90% of the host's RAM (the rest is the OS's and the libraries'), the
        whole disk; without one the device tier is host RAM too: at most 4 GiB or a quarter of it,
        and the host 90% of what is left."""
        if self.device_is_host:
            device = min(4 << 30, self.host_memory // 4)
            return Budgets(device, int(0.9 * (self.host_memory - device)), self.disk_bytes)
        return Budgets(int(0.9 * self.device_memory), int(0.9 * self.host_memory), self.disk_bytes)

    def matmul(self, dtype: str) -> float:
        """Achieved matmul FLOP/s in ``dtype``; one refusal naming the machine where it has none."""
        rate = self.matmul_flops.of(dtype)
        if rate <= 0:
            raise NoRate(f"machine {self.name!r} gives no {dtype} matmul rate; plan with another --precision "
                         "or add matmul_flops to its description")
        return rate

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "machine description") -> "Machine":
        return typed.load_json(cls, text, where, "write one with `tiertrain probe --out FILE`")

    @classmethod
    def read(cls, path: Path) -> "Machine":
        text = typed.read_text(path, "machine description", "write one with `tiertrain probe --out FILE`, or name "
                                     "a built-in machine (tiertrain probe --list)")
        return cls.from_json(text, f"machine description {path}")





class NoRate(ConfigError):
    """A machine description without a rate the plan needs."""


def compute_seconds(flops: float, weight_bytes: float, traffic_bytes: float, m: Machine, dtype: str) -> float:
    """A roofline: matrix products take the longer of their FLOPs at the achieved matmul rate and their
    weights read from memory (small batches are memory-bound); the element-wise work around them
    (norms, activations, residuals, casts) moves ``traffic_bytes`` at the memory bandwidth, after them."""
    return max(flops / m.matmul(dtype), weight_bytes / m.memory_bps) + traffic_bytes / m.memory_bps
