"""Opening a checkpoint's files: only regular files, never through a symlink, never one that would
block, and small ones read with a bound."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from tiertrain.errors import CheckpointError
from tiertrain.units import format_bytes

FIX = "resume from another checkpoint"  # what a damaged checkpoint's message tells the user to do


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file itself: never opened through a
    symlink (O_NOFOLLOW; a checkpoint's files must not lead out of it), never a FIFO or device
    that would block or stream forever (O_NONBLOCK, then fstat)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = {errno.ENOENT: "not found", errno.ELOOP: "a symbolic link, which is never followed"}.get(
            exc.errno, exc.strerror or str(exc))
        raise CheckpointError(f"checkpoint file {path} is missing or damaged ({why}); {FIX}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path} is missing or damaged (not a regular file); {FIX}")
    return fd


def read_small(path: Path, limit: int) -> bytes:
    """A small file's bytes, refused (not read on) when it is larger than ``limit``."""
    with open(open_regular(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"checkpoint file {path} is larger than {format_bytes(limit)}, "
                              f"far beyond what tiertrain writes there; the file is damaged: {FIX}")
    return data
