"""Byte sizes as people write them ("512MiB", "8GiB", "1.5GB") and back."""

from __future__ import annotations

import math
import re

from tiertrain.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size; raise ConfigError naming the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size {text} is negative; give a size such as 512MiB or 8GiB")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read size {text!r}; write a number with a unit such as 512MiB, 8GiB or 2GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float, up: bool = False) -> str:
    """Format bytes with binary units, e.g. 1536 -> '1.50 KiB'. ``up``: round up, not to nearest,
    for a smallest budget the user will type back (1.0625 MiB must not read as 1.06 MiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(n) if up else n:.0f} {unit}"
            return f"{math.ceil(n * 100 - 1e-9) / 100 if up else n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Format a large count the way papers do: 1.3B, 350M, 12.5K."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"
