"""What the user allows each tier to hold."""

from __future__ import annotations

from dataclasses import dataclass

from tiertrain.errors import ConfigError
from tiertrain.units import parse_size


@dataclass(frozen=True)
class Budgets:
    """Bytes per tier. ``disk_dir`` is required when ``disk`` > 0."""

    device: int
    host: int
    disk: int = 0
    disk_dir: str | None = None

    def __post_init__(self) -> None:
        if self.disk and not self.disk_dir:
            raise ConfigError("a disk budget needs a directory: --disk DIR[:SIZE]")

    @classmethod
    def parse(cls, device: str | int, host: str | int, disk: str | None = None) -> "Budgets":
        """Read sizes such as "8GiB" and a disk spec "DIR[:SIZE]" (no size: 0, i.e. no disk pages)."""
        disk_dir, disk_bytes = None, 0
        if disk:
            disk_dir, _, size = disk.rpartition(":") if ":" in disk else (disk, "", "")
            disk_bytes = parse_size(size) if size else 0
        return cls(parse_size(device), parse_size(host), disk_bytes, disk_dir or None)
