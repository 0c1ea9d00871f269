"""Crash-safe file publication: write aside, fsync, rename, fsync the directory.

A reader sees either the old version or the complete new one, never a torn file,
whatever moment the process dies at (SIGKILL, power loss after the fsyncs). A write that
fails (out of space, an I/O error) removes what it wrote aside and leaves the old version.
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
    """Replace ``path`` with ``data`` atomically. The temporary file is created afresh (never
    opened through a symlink someone left under its name) and removed if anything fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a stale one (or a link planted there) is replaced, never written through
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make a fully written directory visible under its final name.

    Every file in ``tmp`` is fsynced first. A directory cannot be renamed over a
    non-empty one, so an existing ``final`` is first moved aside and removed after; if the
    rename fails it is moved back, so ``final`` is never lost. A symlink under the final
    name is replaced as a name: what it points at is never touched.
    """
    for child in tmp.iterdir():
        fsync_path(child)
    fsync_path(tmp)
    old = None
    if os.path.lexists(final):
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_path(final.parent)
    if old is not None:
        if old.is_symlink() or not old.is_dir():
            old.unlink(missing_ok=True)
        else:
            shutil.rmtree(old, ignore_errors=True)  # what is left is removed by the next save (remove_stale)
