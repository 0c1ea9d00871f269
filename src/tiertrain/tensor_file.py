"""safetensors files written one tensor at a time, and read one tensor at a time.

Why the writer is by hand: safetensors' Python API serialises a dict whose tensors are all in
memory at once, and a tiered run's weights and moments are larger than memory (they live on disk
between steps), so a checkpoint streams them block by block. The format is small: an 8-byte
little-endian header length, a JSON header (dtype, shape and byte range of each tensor), then
the raw bytes in header order. Files are read back with safetensors itself (``safe_open``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch
from crc32c import crc32c
from safetensors import SafetensorError, safe_open

from tiertrain.errors import CheckpointError, one_line

DIRTY_BYTES = 64 << 20  # written through the page cache before it is flushed and dropped (``_settle``)
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
DTYPES = _DTYPES  # safetensors' dtype codes -> torch dtypes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


PIECE_BYTES = 64 << 20  # what a streamed write holds of one tensor at a time (``TensorStream.pieces``)


@dataclass(frozen=True)
class TensorStream:
    """Tensors named up front, produced in that order only when written (``tensors`` may read them
    from disk a parameter at a time, so at most one parameter's worth is in memory). ``pieces``, where
    given, yields the same bytes in order in pieces of any size: the writer takes them, so at most a
    piece is in memory (a 1.7B's embedding read whole for a checkpoint held 463 MB beside the budgets)."""

    specs: list[TensorSpec]
    tensors: Callable[[], Iterator[torch.Tensor]]
    pieces: Callable[[], Iterator[torch.Tensor]] | None = None

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> TensorStream:
        specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
        return cls(specs, lambda: iter(tensors.values()))


class PieceCrcs:
    """CRC-32C of each ``piece``-byte piece of a byte stream, as it streams (the last piece may be short)."""

    def __init__(self, piece: int) -> None:
        self.piece, self.pieces = piece, []
        self._crc, self._filled = 0, 0

    def update(self, data: memoryview | bytes) -> None:
        pos = 0
        while pos < len(data):
            take = min(self.piece - self._filled, len(data) - pos)
            self._crc = crc32c(data[pos : pos + take], self._crc)
            self._filled, pos = self._filled + take, pos + take
            if self._filled == self.piece:
                self.pieces.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> PieceCrcs:
        if self._filled:
            self.pieces.append(self._crc)
            self._crc, self._filled = 0, 0
        return self


def streamed_bytes(stream: TensorStream, metadata: dict[str, str] | None = None) -> int:
    """The size of the file ``write_streamed`` makes of ``stream``."""
    return len(_header(stream, metadata)) + 8 + sum(s.nbytes for s in stream.specs)


def _header(stream: TensorStream, metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for s in stream.specs:
        header[s.name] = {"dtype": _CODES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it


def write_streamed(path: Path, stream: TensorStream, metadata: dict[str, str] | None = None,
                   pieces: PieceCrcs | None = None) -> int:
    """Write ``stream`` as a safetensors file; return the CRC-32C of the bytes written, so a
    checkpoint's manifest needs no second pass over a file larger than memory (hardware CRC-32C
    runs at ~10 GB/s here, sha256 at 0.4 GB/s: 15 s on a 6 GB checkpoint). ``pieces``: also the
    CRC-32C of each piece of the file, for readers of parts of it (``checkpoint.pieces``)."""
    raw = _header(stream, metadata)
    offset = sum(s.nbytes for s in stream.specs)
    crc = 0
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(raw)), raw):
            f.write(part)
            crc = crc32c(part, crc)
            if pieces is not None:
                pieces.update(part)
        written, dirty = 0, 0
        for part in _parts(stream, path):
            data = memoryview(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            crc = crc32c(data, crc)
            if pieces is not None:
                pieces.update(data)
            written, dirty = written + len(data), dirty + len(data)
            del part, data  # before the next is made: one piece in memory at a time
            if dirty >= DIRTY_BYTES:
                _settle(f)
                dirty = 0
        if written != offset:
            raise RuntimeError(f"{path.name}: {written} bytes of tensors produced, {offset} announced")
    if pieces is not None:
        pieces.finish()
    return crc


def _parts(stream: TensorStream, path: Path) -> Iterator[torch.Tensor]:
    """The stream's bytes in order: its pieces, or each tensor, checked against its spec."""
    if stream.pieces is not None:
        yield from stream.pieces()
        return
    produced = 0
    for spec, t in zip(stream.specs, stream.tensors()):
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise RuntimeError(f"{spec.name}: produced {t.dtype} {tuple(t.shape)}, announced {spec.dtype} {spec.shape}")
        produced += 1
        yield t
        del t
    if produced != len(stream.specs):
        raise RuntimeError(f"{path.name}: {produced} tensors produced, {len(stream.specs)} announced")


def _settle(f: BinaryIO) -> None:
    """Write what the page cache holds of ``f`` to disk and drop it from the cache.

    A memory cgroup counts its page cache, and cgroup v1 does not throttle a group's dirty pages:
    a checkpoint of several GB written through the cache could reach the cap before writeback
    freed any, and the run was killed for memory while saving (seen once under an 896 MiB cap).
    Bounding the dirty bytes to ``DIRTY_BYTES`` keeps a capped run alive; the final fsync waits
    for the same writes either way."""
    f.flush()
    getattr(os, "fdatasync", os.fsync)(f.fileno())  # macOS has no fdatasync
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


REMAP_BYTES = 256 << 20


class LazyTensors(Mapping[str, torch.Tensor]):
    """A safetensors file as a mapping whose tensors are read when looked up, one at a time.

    Names, dtypes and shapes come from the header alone (the file is mapped, not read), so a
    checkpoint's tensors are checked against the model before a byte of them is loaded, and a
    damaged header that declares huge sizes is refused by safetensors' own checks (sizes must
    match the file) without anything of that size being allocated. Every failure to read is one
    ``CheckpointError`` naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mapped = 0  # bytes read through the current mapping
        self._open()
        self._keys = list(self._file.keys())
        self._names = set(self._keys)

    def _open(self) -> None:
        try:
            self._file = safe_open(str(self.path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {self.path}: {one_line(exc)}; the file is damaged: "
                                  "resume from another checkpoint") from None

    def _read_through(self, nbytes: int) -> None:
        """The file is mapped, and each page a read touched stays resident in the process until the
        mapping goes: a 354M resume held 4.1 GB of checkpoint pages beside 2 GB of budgets. So the
        file is mapped afresh after every ``REMAP_BYTES`` read (its header read again: small)."""
        self._mapped += nbytes
        if self._mapped >= REMAP_BYTES:
            self._open()
            self._mapped = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | None:
        """The tensor's dtype as the header declares it; None for one torch cannot hold here."""
        return _DTYPES.get(self._slice(name).get_dtype())

    def _slice(self, name: str):  # noqa: ANN202 (safetensors' PySafeSlice)
        try:
            return self._file.get_slice(name)
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read {name!r} in {self.path}: {one_line(exc)}; "
                                  "resume from another checkpoint") from None

    def read_range(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of a 1-D tensor, read without the rest of it."""
        try:
            out = self._slice(name)[lo:hi]
            self._read_through(out.numel() * out.element_size())
            return out
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {name!r} in {self.path}: {one_line(exc)}; "
                                  "resume from another checkpoint") from None

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's default would
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        try:
            out = self._file.get_tensor(name)
            self._read_through(out.numel() * out.element_size())
            return out
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {name!r} in {self.path}: {one_line(exc)}; "
                                  "resume from another checkpoint") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
