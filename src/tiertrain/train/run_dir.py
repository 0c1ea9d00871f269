"""A run directory belongs to one run at a time, and a new run never writes over another's work.

The lock is an advisory ``flock`` on ``OUT/.lock``: the kernel releases it when the process dies,
however it dies, so a crashed run never leaves the directory locked. The file holds the
holder's pid, which a refused run names.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from tiertrain.errors import OutputError

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
CHECKPOINTS = "checkpoints"


class RunDirBusy(OutputError):
    """Another process is training into the same run directory."""


class RunDirTaken(OutputError):
    """The directory holds another run's checkpoints or metrics, and nothing said what to do with them."""


class RunDir:
    """``OUT``, locked for this process until ``release`` (or its death)."""

    def __init__(self, out: Path) -> None:
        self.path = out
        self._fd: int | None = None

    def lock(self) -> None:
        """Take the directory, or refuse at once naming the process that has it."""
        path = self.path / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot create {path} ({exc.strerror}); choose another --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OutputError(f"cannot lock {path} ({exc.strerror}); choose another --out") from None
            raise RunDirBusy(f"run directory {self.path} is in use by another tiertrain run (pid {holder}); "
                             "wait for it to finish, or give another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def refuse_if_busy(self) -> None:
        """Before resuming it: a run still training here has maybe no checkpoint yet, and "no
        checkpoint found" would hide that it is running. Nothing is created or kept. The test takes a
        shared lock, which only a run's exclusive one refuses: every rank of a resume under torchrun
        tests the directory it resumes from at once, and with an exclusive test one rank now and then
        found another's test holding it and refused (CI, 2026-11-26)."""
        try:
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return  # no lock file: no run ever held it (what is missing is said by the resume itself)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirBusy(f"run directory {self.path} is in use by another tiertrain run (pid "
                                 f"{_read_pid(fd)}); wait for it to stop (Ctrl-C or SIGTERM saves a checkpoint), "
                                 f"then --resume it") from None
        finally:
            os.close(fd)  # closing it drops a lock just taken

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def holds_a_run(self) -> bool:
        """Whether a run has left checkpoints or metrics rows here."""
        root = self.path / CHECKPOINTS
        if root.is_dir() and any(p.name == "latest" or p.name.startswith("step-") for p in root.iterdir()):
            return True
        metrics = self.path / METRICS_FILE
        return metrics.is_file() and metrics.stat().st_size > 0

    def claim_for_new_run(self, overwrite: bool) -> None:
        """A new run (not a resume) starts here: refuse if another's work is here, unless
        ``overwrite`` says to remove it (its checkpoints, metrics and plan)."""
        if not self.holds_a_run():
            return
        if not overwrite:
            raise RunDirTaken(f"{self.path} already holds a run's checkpoints or metrics; continue it with "
                              f"--resume {self.path}, replace it with --overwrite, or give another --out")
        shutil.rmtree(self.path / CHECKPOINTS, ignore_errors=True)
        for name in (METRICS_FILE, PLAN_FILE):
            (self.path / name).unlink(missing_ok=True)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"
