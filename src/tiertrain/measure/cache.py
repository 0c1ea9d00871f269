"""The one cache of measurements: page sizes, machine probes and model profiles.

Measuring costs seconds to minutes, so each figure is kept per machine and what it was measured
for, under ``$TIERTRAIN_CACHE_DIR`` (else ``$XDG_CACHE_HOME/tiertrain``, else
``~/.cache/tiertrain``): one JSON file per entry, ``KIND/<hash of key>.json``, holding the key
itself (a hash collision or a damaged file reads as a miss, and is measured again). Written
whole or not at all (a temporary file per process, then a rename), so concurrent runs never
read half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    base = os.environ.get("TIERTRAIN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiertrain"


def _path(kind: str, key: str) -> Path:
    return cache_dir() / kind / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def load(kind: str, key: str) -> Any | None:
    """The value stored for ``key``, or None (never stored, damaged, or another key's)."""
    try:
        entry = json.loads(_path(kind, key).read_text())
    except (OSError, ValueError):
        return None
    return entry.get("value") if isinstance(entry, dict) and entry.get("key") == key else None


def store(kind: str, key: str, value: Any) -> None:
    """Keep ``value`` (plain JSON data) for ``key``; a cache that cannot be written is skipped."""
    path = _path(kind, key)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "value": value}, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def forget(kind: str, key: str) -> None:
    """Drop the value stored for ``key`` (a measurement found wrong), so the next run measures again."""
    try:
        _path(kind, key).unlink(missing_ok=True)
    except OSError:
        pass
