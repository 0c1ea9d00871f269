"""What the user allows each tier to hold: one type from the command line and ``tiertrain.setup`` to
the planner's search, the fit check and the pools (nothing converts it to another shape on the way).

Sizes are bytes; strings such as ``"512MiB"`` or ``"8GiB"`` are read at construction, so a budget
that cannot be used is refused where it is written, naming the field, never deep inside a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiertrain.errors import ConfigError
from tiertrain.plan.tiers import Tier
from tiertrain.units import parse_size


@dataclass(frozen=True)
class Budgets:
    """Bytes per tier (an int, or a size string: ``Budgets(device="2GiB", host="8GiB")``). A run with a
    disk budget needs ``disk_dir``, the directory its files go in (created there, private, removed at the
    end); a machine the planner only describes has a disk size alone."""

    device: int
    host: int
    disk: int = 0
    disk_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("device", "host", "disk"):
            object.__setattr__(self, name, _size(name, getattr(self, name)))
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            object.__setattr__(self, "disk_dir", _directory(self.disk_dir))

    def check_disk_dir(self) -> None:
        """A run that keeps pages on disk must say where."""
        if self.disk and not self.disk_dir:
            raise ConfigError("a disk budget needs a directory: Budgets(..., disk=SIZE, disk_dir=DIR), or --disk DIR:SIZE")

    def __getitem__(self, tier: Tier) -> int:
        """The budget of one tier: ``budgets[Tier.HOST]``."""
        return {Tier.DEVICE: self.device, Tier.HOST: self.host, Tier.DISK: self.disk}[Tier(tier)]

    @classmethod
    def parse(cls, device: str | int, host: str | int, disk: str | None = None) -> "Budgets":
        """The command line's form: sizes, and a disk spec "DIR[:SIZE]" (no size: 0, i.e. no disk pages)."""
        disk_dir, disk_bytes = None, 0
        if disk:
            disk_dir, _, size = disk.rpartition(":") if ":" in disk else (disk, "", "")
            disk_bytes = parse_size(size) if size else 0
        return cls(device, host, disk_bytes, disk_dir or None)


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"Budgets.{name} must be a size in bytes or a string such as '8GiB', "
                          f"got {type(value).__name__} {value!r}")
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"Budgets.{name}: {exc}") from None


def _directory(value: object) -> str:
    import os

    try:
        return os.fspath(value)
    except TypeError:
        raise ConfigError(f"Budgets.disk_dir must be a directory path, got {type(value).__name__} {value!r}") from None
