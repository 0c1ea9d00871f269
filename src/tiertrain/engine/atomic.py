"""Crash-safe file publication: write aside, fsync, rename, fsync the directory.

A reader sees either the old version or the complete new one, never a torn file,
whatever moment the process dies at (SIGKILL, power loss after the fsyncs).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make a fully written directory visible under its final name.

    Every file in ``tmp`` is fsynced first. A directory cannot be renamed over a
    non-empty one, so an existing ``final`` is first moved aside and removed after.
    """
    for child in tmp.iterdir():
        fsync_path(child)
    fsync_path(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old)
