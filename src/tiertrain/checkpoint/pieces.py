"""A sharded checkpoint's rank files, checked piece by piece as they are read.

A file's CRC-32C in the manifest can only be checked by reading the whole file, so every rank of a
resume read every rank file once to verify it and again for its own parameters (about 2N reads of
the checkpoint over N ranks). Each rank file is therefore also checksummed in pieces (``<file>.pieces``
beside it, itself in the manifest): a resuming rank reads the byte ranges its own shards span, checks
each piece they touch once, and never reads the rest. At most 4096 pieces per file (a piece is the
file's size / 4096, rounded up to 4 KiB): the list stays small, and what a rank reads beyond its bytes
is at most two pieces per range it reads.

Read with ``os.pread`` on a descriptor opened as every checkpoint file is (``regular_file``), not
through safetensors' mapping: the bytes are checked before they become a tensor. The header is the
safetensors header, parsed here for the tensors' offsets (its names, dtypes and shapes are checked
against the checkpoint's map before anything is read: ``sharded.check_shard_files``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from crc32c import crc32c

from tiertrain.checkpoint.regular_file import FIX as _FIX
from tiertrain.checkpoint.regular_file import open_regular, read_small
from tiertrain.errors import CheckpointError
from tiertrain.tensor_file import DTYPES, PieceCrcs

SUFFIX = ".pieces"
MAX_PIECES = 4096


def piece_size(file_bytes: int) -> int:
    """Bytes of each checksummed piece of a file of ``file_bytes``: at most ``MAX_PIECES`` pieces."""
    per = -(-file_bytes // MAX_PIECES)
    return max(4096, -(-per // 4096) * 4096)


def write_pieces(path: Path, crcs: PieceCrcs) -> None:
    """``<path>.pieces``: the piece size and each piece's CRC-32C of the file just written."""
    data = {"piece": crcs.piece, "crc32c": [f"{c:08x}" for c in crcs.pieces]}
    with open(path.with_name(path.name + SUFFIX), "w") as f:
        json.dump(data, f, separators=(",", ":"))


@dataclass
class ReadCount:
    """Bytes this process read from rank files by range (the tests and ``bench`` count a resume's reads)."""

    bytes: int = 0


READ = ReadCount()


class CheckedRanges:
    """A rank file read by element ranges of its 1-D tensors, each piece checked against its CRC-32C the
    first time a range touches it; a mismatch (or a short read) is one ``CheckpointError``."""

    def __init__(self, path: Path) -> None:
        self.path, self._fd = path, -1
        try:
            listed = json.loads(read_small(path.with_name(path.name + SUFFIX), 64 << 20))
            self.piece = int(listed["piece"])
            self.crcs = [int(c, 16) for c in listed["crc32c"]]
        except (KeyError, TypeError, ValueError, RecursionError):
            raise CheckpointError(f"{path}{SUFFIX} is not a list of piece checksums; the checkpoint is damaged: "
                                  f"{_FIX}") from None
        self._checked: set[int] = set()
        fd = open_regular(path)
        self._fd = fd
        self.size = os.fstat(fd).st_size
        if self.piece < 4096 or len(self.crcs) != -(-self.size // self.piece):
            raise CheckpointError(f"{path}: its piece checksums do not cover it; the checkpoint is damaged: {_FIX}")
        (n,) = struct.unpack("<Q", self._bytes(0, 8))  # the header too: checked by its pieces
        if 8 + n > self.size:
            raise CheckpointError(f"{path}: its header claims {n} bytes, more than the file; the checkpoint is "
                                  f"damaged: {_FIX}")
        self._base = 8 + n
        try:
            self._tensors = json.loads(self._bytes(8, 8 + n))
        except (ValueError, RecursionError):
            raise CheckpointError(f"{path}: its header is not JSON; the checkpoint is damaged: {_FIX}") from None
        if not isinstance(self._tensors, dict):
            raise CheckpointError(f"{path}: its header is not a mapping; the checkpoint is damaged: {_FIX}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def _pread(self, at: int, nbytes: int) -> bytes:
        data = os.pread(self._fd, nbytes, at)
        if len(data) != nbytes:
            raise CheckpointError(f"{self.path} is shorter than its header says (read {len(data)} of {nbytes} "
                                  f"bytes at {at}); the checkpoint is damaged: {_FIX}")
        READ.bytes += nbytes
        return data

    def _bytes(self, lo: int, hi: int) -> bytes:
        """File bytes [lo, hi): the pieces it touches read whole and checked where not checked before."""
        first, last = lo // self.piece, (hi - 1) // self.piece if hi > lo else lo // self.piece - 1
        fresh = [i for i in range(first, last + 1) if i not in self._checked]
        if not fresh:
            return self._pread(lo, hi - lo)
        a = min(lo, fresh[0] * self.piece)  # one read: the range and the unchecked pieces it touches
        z = max(hi, min(self.size, (fresh[-1] + 1) * self.piece))
        span = self._pread(a, z - a)
        for i in fresh:
            part = span[i * self.piece - a : min(self.size, (i + 1) * self.piece) - a]
            if crc32c(part) != self.crcs[i]:
                raise CheckpointError(f"checkpoint file {self.path} is damaged (piece {i} of {len(self.crcs)}: "
                                      f"checksum mismatch); resume from an earlier checkpoint")
            self._checked.add(i)
        return span[lo - a : hi - a]

    def read_range(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the 1-D tensor ``name``."""
        entry = self._tensors.get(name)
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is None:
            raise CheckpointError(f"cannot read {name!r} in {self.path}; the checkpoint is damaged: {_FIX}")
        try:
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name!r} in {self.path} has no offsets; the checkpoint is damaged: {_FIX}") from None
        size = dtype.itemsize
        if not 0 <= lo <= hi or start + hi * size > end:
            raise CheckpointError(f"{name!r} in {self.path} holds fewer elements than its map says: {_FIX}")
        data = self._bytes(self._base + start + lo * size, self._base + start + hi * size)
        return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.zeros(0, dtype=dtype)
