"""The disk tier: one private page file per run, O_DIRECT where the filesystem allows it.

Why by hand: no maintained Python package gives aligned, checksummed, page-addressed
files with clean error reporting; ``os.pwrite``/``os.preadv`` release the GIL, so a few
worker threads keep several requests in flight (BENCHMARKS.md: deeper queues than ~8
were no faster on these disks).

Integrity: a page's CRC (CRC-32C in hardware, else zlib's CRC-32; checksums live only
as long as the run, so the choice never has to match another run) is recorded only after
its write fully succeeded, and is
checked on every read before a byte is handed back; a failed write forgets the page's
old checksum, so half-written data can never be read as valid.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import weakref
from pathlib import Path

try:  # hardware CRC-32C: measured 9.5 GB/s here against zlib's 2.2 GB/s, and it releases the GIL
    from crc32c import crc32c as checksum
except ImportError:  # pragma: no cover - the dependency is declared; keep working without it
    from zlib import crc32 as checksum

from tiertrain.errors import ConfigError, DiskError
from tiertrain.memory.pool import IO_ALIGN, Pool, host_buffer
from tiertrain.plan.tiers import Tier
from tiertrain.units import format_bytes

log = logging.getLogger("tiertrain")
RUN_PREFIX = "tiertrain-run-"
OWNER_FILE = "owner.json"


MARKER = "tiertrain-disk-tier"  # what a marker says, so no other file can pass for one
PAGES_FILE = "pages.bin"


def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot; tells a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _identity() -> dict:
    """Who made a disk-tier directory: this process, on this machine, as this user."""
    return {"marker": MARKER, "pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(),
            "uid": os.getuid()}


def _ours_and_abandoned(path: Path) -> bool:
    """Whether ``path`` is a disk-tier directory a tiertrain run made here and left behind: its marker
    says so, it belongs to this user, its owner process is gone, and it holds nothing but our files.
    Anything else under the same name pattern is somebody's data and is never touched."""
    try:
        info = os.lstat(path)
        owner = json.loads((path / OWNER_FILE).read_text())
        names = set(os.listdir(path))
    except (OSError, ValueError):
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or not isinstance(owner, dict):
        return False
    if owner.get("marker") != MARKER or owner.get("host") != socket.gethostname() or owner.get("uid") != os.getuid():
        return False
    if not names <= {OWNER_FILE, PAGES_FILE}:
        return False
    pid = owner.get("pid")
    return not (isinstance(pid, int) and _start_time(pid) == owner.get("start"))


def remove_stale(root: Path) -> list[Path]:
    """Remove the disk-tier directories under ``root`` that crashed runs left (``_ours_and_abandoned``);
    an empty one (a run killed before it wrote its marker) goes too, since removing it loses nothing."""
    removed = []
    for path in root.glob(f"{RUN_PREFIX}*"):
        if _ours_and_abandoned(path):
            for name in (PAGES_FILE, OWNER_FILE):
                (path / name).unlink(missing_ok=True)
        try:
            path.rmdir()  # only ever succeeds on an empty directory
            removed.append(path)
        except OSError:
            continue
    if removed:
        log.warning("removed %d stale disk-tier director%s left by crashed runs under %s",
                    len(removed), "y" if len(removed) == 1 else "ies", root)
    return removed


def make_disk_dir(root: Path) -> None:
    """The directory the user named for the disk tier, created if need be, but only in a directory that
    exists: a typo, or a disk not mounted, must not build a tree on another filesystem (the root's)."""
    if not root.parent.is_dir():
        raise ConfigError(f"disk directory {root} does not exist, nor does {root.parent}: is the disk mounted? "
                          f"Create it first (mkdir -p {root}) or name an existing directory with --disk")
    root.mkdir(exist_ok=True)


class DiskDir:
    """This run's private directory (0700) under the directory the user named."""

    def __init__(self, root: str | Path) -> None:
        root = Path(root)
        try:
            make_disk_dir(root)
            self.stale_removed = remove_stale(root)
            self.path = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=root))  # mkdtemp: mode 0700
        except OSError as exc:
            raise ConfigError(f"disk directory {root} cannot be written ({_errname(exc)}: {exc.strerror}); "
                              "name a writable directory with --disk") from None
        self._finalizer = weakref.finalize(self, _remove_own, self.path)
        try:
            fd = os.open(self.path / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(_identity(), f)
        except OSError as exc:
            self.close()
            raise ConfigError(f"disk directory {root} cannot be written ({_errname(exc)}: {exc.strerror}); "
                              "name a writable directory with --disk") from None

    def close(self) -> None:
        """Remove this run's directory, and those of runs that died beside it (another rank of a data-parallel
        run killed on this machine cannot remove its own): only what a marker proves abandoned."""
        self._finalizer()
        remove_stale(self.path.parent)


def _remove_own(path: Path) -> None:
    """Remove this run's own directory: only the files the disk tier puts there, then the directory."""
    for name in (PAGES_FILE, OWNER_FILE):
        try:
            (path / name).unlink()
        except OSError:
            pass
    try:
        path.rmdir()
    except OSError:
        log.warning("disk-tier directory %s was not empty at the end of the run; left in place", path)


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "error")


class DiskPool(Pool):
    """Pages in one file. Chunks start on page boundaries here (whole-page, aligned I/O)."""

    def __init__(self, budget: int, page_size: int, directory: DiskDir, reserve: bool = True) -> None:
        super().__init__(Tier.DISK, budget, page_size, share_pages=False)
        self.dir = directory
        self.file = directory.path / PAGES_FILE
        self._checksums: dict[int, tuple[int, int]] = {}
        self._count_lock = threading.Lock()
        self.bytes_read = 0     # bytes this pool read and wrote (whole 4 KiB sectors: what the disk moved),
        self.bytes_written = 0  # so a run can hold its traffic against the planner's prediction
        self.direct = self._open()
        if reserve and self.capacity:
            self._reserve()

    def _open(self) -> bool:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self.fd = os.open(self.file, flags | os.O_DIRECT, 0o600)
            probe, _region = host_buffer(IO_ALIGN, pin=False)
            os.pwrite(self.fd, memoryview(probe.numpy()), 0)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise DiskError(f"cannot open disk-tier file {self.file}: {exc.strerror}") from None
            if getattr(self, "fd", None) is not None:
                os.close(self.fd)
                os.unlink(self.file)
            log.warning("the filesystem of %s does not support O_DIRECT; the disk tier uses buffered I/O "
                        "(reads may be served from the page cache)", self.dir.path)
            self.fd = os.open(self.file, flags, 0o600)
            return False

    def _reserve(self) -> None:
        """Claim the whole budget on disk now, so a full disk is found at start, not mid-run."""
        try:
            os.posix_fallocate(self.fd, 0, self.capacity)
        except OSError as exc:
            free = shutil.disk_usage(self.dir.path).free
            raise DiskError(
                f"cannot reserve {format_bytes(self.capacity)} for the disk tier in {self.dir.path} "
                f"({_errname(exc)}: {exc.strerror}; {format_bytes(free)} free); lower the disk budget "
                "or name a directory on a larger disk"
            ) from None

    def write_page(self, page: int, data: memoryview) -> None:
        """Write ``data`` (aligned, a multiple of 4 KiB) at the start of ``page``."""
        offset = page * self.page_size
        self._checksums.pop(page, None)  # a failed write must not leave old data looking valid
        written = 0
        while written < len(data):  # a short write is legal; the next call reports why (ENOSPC, EIO)
            try:
                n = os.pwrite(self.fd, data[written:], offset + written)
            except OSError as exc:
                raise DiskError(f"writing {len(data)} bytes to {self.file} at offset {offset} failed after "
                                f"{written}: {_errname(exc)} ({exc.strerror})") from None
            if n == 0:
                raise DiskError(f"short write to {self.file} at offset {offset}: {written} of {len(data)} bytes")
            written += n
        self._checksums[page] = (checksum(data), len(data))
        with self._count_lock:
            self.bytes_written += len(data)

    def traffic(self) -> tuple[int, int]:
        """(bytes read, bytes written) since the pool was made."""
        with self._count_lock:
            return self.bytes_read, self.bytes_written

    def written_length(self, page: int) -> int:
        if page not in self._checksums:
            raise DiskError(f"page at offset {page * self.page_size} of {self.file} was never written completely")
        return self._checksums[page][1]

    def read_page(self, page: int, out: memoryview) -> None:
        """Read the page's written bytes into ``out`` and verify them; raise rather than return bad data."""
        offset = page * self.page_size
        n = self.written_length(page)
        crc = self._checksums[page][0]
        got = 0
        while got < n:  # continue a short read; end of file before n bytes is an error
            try:
                k = os.preadv(self.fd, [out[got:n]], offset + got)
            except OSError as exc:
                raise DiskError(f"reading {n} bytes from {self.file} at offset {offset} failed: "
                                f"{_errname(exc)} ({exc.strerror})") from None
            if k <= 0:
                raise DiskError(f"short read from {self.file} at offset {offset}: {got} of {n} bytes")
            got += k
        with self._count_lock:
            self.bytes_read += n
        if checksum(out[:n]) != crc:
            raise DiskError(f"checksum mismatch in {self.file} at offset {offset} ({n} bytes): "
                            "the disk returned different data than was written")

    def release(self, extents: list) -> None:
        super().release(extents)
        for e in extents:
            if self.table.owners(e.page) == 0:
                self._checksums.pop(e.page, None)

    def close(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
        self.dir.close()
