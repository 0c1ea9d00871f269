"""Asynchronous moves of chunks between tiers.

``move`` allocates the destination at once (so a budget refusal is raised to the caller,
with nothing changed), then hands the copying to worker threads and returns a Handle.
Memory copies run on copy workers (numpy/torch copies release the GIL; with CUDA they are
issued on a dedicated copy stream that first waits on an event recorded on the compute
stream, so the compute stream is never synchronised). Disk moves are split into one
request per page across the I/O workers, so several requests are in flight at once; the
workers take reads before write-backs (``io_queue``).
A move that fails frees its destination and leaves the chunk whole where it was.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from tiertrain.memory.accounting import Accounting
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.disk import DiskPool
from tiertrain.memory.io_queue import READ, WRITE, PriorityPool
from tiertrain.memory.pages import Extent
from tiertrain.memory.pool import IO_ALIGN, MemoryPool, Pool, host_buffer
from tiertrain.plan.tiers import Tier


class Handle:
    """Something to wait on: ``wait()`` returns when the move is complete, or raises its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("move did not finish in time")
        if self._error is not None:
            raise self._error

    def wait_done(self) -> None:
        """Return when the move has finished, well or not (its error stays for ``wait``)."""
        self._done.wait()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """CPU: np.copyto (memmove speed, about 2x Tensor.copy_ here; BENCHMARKS.md). CUDA: copy_."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=True)


def landed(chunk: Chunk) -> None:
    """Before reading a chunk where it lies: a move still under way (a master copied out of its slot
    to the host) gives its old place back when it lands, so wait for it and read it where it is then."""
    pending = chunk.pending
    if pending is not None:
        pending.wait_done()


class _Join:
    """Calls ``finish(first_error)`` once all ``n`` parts have completed."""

    def __init__(self, n: int, finish: Callable[[BaseException | None], None]) -> None:
        self._left, self._error, self._finish = n, None, finish
        self._lock = threading.Lock()

    def part_done(self, fut: Future) -> None:
        with self._lock:
            if fut.exception() is not None and self._error is None:
                self._error = fut.exception()
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish(self._error)


class Mover:
    def __init__(self, pools: dict[Tier, Pool], accounting: Accounting, io_workers: int = 8,
                 copy_workers: int = 2, write_share: int = 0) -> None:
        self.pools, self.accounting = pools, accounting
        self._io = PriorityPool(io_workers, "tiertrain-io", write_share)  # reads before write-backs, or beside them
        self._copy = ThreadPoolExecutor(copy_workers, thread_name_prefix="tiertrain-copy")
        self._local = threading.local()
        self._cuda = torch.cuda.is_available() and any(
            isinstance(p, MemoryPool) and p.device.type == "cuda" for p in pools.values())
        self._streams = {"h2d": torch.cuda.Stream(), "d2h": torch.cuda.Stream()} if self._cuda else {}

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._copy.shutdown(wait=True)

    def move(self, chunk: Chunk, target: Tier, contiguous: bool = False) -> Handle:
        handle, src, dst, extents = self._begin(chunk, target, contiguous)
        if dst is None:
            return handle
        parts = self._parts(chunk, src, dst, extents)
        join = _Join(len(parts), lambda err: self._complete(chunk, handle, src, dst, extents, err))
        if not parts:  # an empty chunk: nothing to copy
            self._complete(chunk, handle, src, dst, extents, None)
        self._submit(parts, join)
        return handle

    def move_from(self, chunk: Chunk, target: Tier, source: Chunk, contiguous: bool = False) -> Handle:
        """``move``, with the bytes taken from ``source``, a memory chunk known to hold them (a device
        slot filled from this chunk), not read where the chunk lies: copied on a copy worker, so the
        caller (backward, on the main thread) goes on at once; ``source`` must not be written again
        until the handle is done (``Slot.read_by``). No compute-stream event is waited for: the caller
        knows ``source`` complete (a slot whose fill it waited for, which compute only reads)."""
        if source.nbytes < chunk.nbytes:
            raise ValueError(f"move_from needs a source at least as large, got {source!r} for {chunk!r}")
        handle, src, dst, extents = self._begin(chunk, target, contiguous)
        if dst is None:
            return handle
        target_chunk = Chunk(chunk.name, chunk.kind, chunk.nbytes, dst, extents)
        join = _Join(1, lambda err: self._complete(chunk, handle, src, dst, extents, err))
        try:
            self._submit([(self._copy.submit, lambda: self._on_copy_stream(
                target, None, lambda: self._scatter(target_chunk, 0, source, 0, chunk.nbytes)))], join)
        except BaseException as exc:  # not queued (workers shut down): a handle nobody finishes would hang
            self._complete(chunk, handle, src, dst, extents, exc)
        return handle

    def _begin(self, chunk: Chunk, target: Tier, contiguous: bool) -> tuple[Handle, Pool, Pool | None, list[Extent]]:
        """A move's destination allocated and counted (a BudgetError here leaves everything as it was);
        no destination (and a finished handle) where the chunk is there already."""
        with chunk.lock:
            chunk.check_usable()
            handle = Handle()
            if chunk.tier is target:
                handle._finish(None)
                return handle, chunk.pool, None, []
            src, dst = chunk.pool, self.pools[target]
            extents = dst.allocate(chunk.nbytes, contiguous and target is not Tier.DISK)
            self.accounting.add(target, chunk.kind, chunk.nbytes)
            chunk.pending = handle
        return handle, src, dst, extents

    def copy(self, src: Chunk, dst: Chunk) -> Handle:
        """Copy ``src``'s bytes into ``dst`` (same size; ``dst`` in memory), asynchronously.

        Fills device slots from their homes, on host or on disk: the destination keeps its
        pages and ``src`` stays where it is. A disk source is read page by page and verified."""
        if src.nbytes > dst.nbytes or dst.tier is Tier.DISK:
            raise ValueError(f"copy needs a memory destination at least as large, got {src!r} and {dst!r}")
        landed(src)
        event = self._compute_event()  # ``dst`` (a slot) may still be read by kernels queued before now
        if isinstance(src.pool, DiskPool):
            parts = [(self._read_disk, self._reader(dst, src.pool, e, i * src.pool.page_size, event))
                     for i, e in enumerate(src.extents)]
        else:
            parts = [(self._copy.submit, lambda: self._on_copy_stream(dst.tier, event, lambda: self._scatter(
                dst, 0, src, 0, src.nbytes)))]
        return self._joined(parts)

    def read_pages(self, chunk: Chunk, first: int, count: int, out: torch.Tensor) -> Handle:
        """Pages ``[first, first + count)`` of a disk chunk into ``out`` (uint8, page-aligned, ``count``
        pages long), verified; the chunk stays on disk. A piecewise update reads its states so."""
        landed(chunk)
        disk = self._disk_of(chunk)
        ps = disk.page_size
        return self._page_io(chunk, first, count, self._read_disk, lambda i, e: lambda: disk.read_page(
            e.page, memoryview(out[i * ps : (i + 1) * ps].numpy())))

    def read_into(self, chunk: Chunk, out: torch.Tensor) -> Handle:
        """A disk chunk's bytes into ``out`` (uint8, in host or device memory, as long as the chunk's bytes
        or shorter), page by page on the read workers, each page verified before a byte of it is used:
        a sharded block's own shard read into its place in a device slot off the step's thread."""
        landed(chunk)  # a move under way changes where its pages are: read them where they are then
        disk = self._disk_of(chunk)
        ps, event = disk.page_size, self._compute_event()  # the slot may still be read by kernels queued now
        tier = Tier.HOST if out.device.type == "cpu" else Tier.DEVICE

        def reader(pos: int, e: Extent) -> Callable[[], None]:  # e: the part of a page in the range
            def read() -> None:
                stage = self._staging(ps)
                disk.read_page(e.page, memoryview(stage.numpy()))  # raises on a short read or a bad checksum
                self._on_copy_stream(tier, event, lambda: out[pos : pos + e.length].copy_(
                    stage[e.offset : e.offset + e.length]))
            return read
        return self._joined([(self._read_disk, reader(pos, e)) for pos, e in chunk.segments(0, out.numel())])

    def write_pages(self, chunk: Chunk, first: int, count: int, src: torch.Tensor) -> Handle:
        """``src`` (as ``read_pages`` filled it) written back over pages ``[first, first + count)`` of a
        disk chunk, in place: each page's checksum is forgotten before its write and recorded after."""
        disk = self._disk_of(chunk)
        ps = disk.page_size

        def writer(i: int, e: Extent) -> Callable[[], None]:
            padded = -(-e.length // IO_ALIGN) * IO_ALIGN
            return lambda: disk.write_page(e.page, memoryview(src[i * ps : i * ps + padded].numpy()))
        return self._page_io(chunk, first, count, self._write_disk, writer)

    @staticmethod
    def _disk_of(chunk: Chunk) -> DiskPool:
        if not isinstance(chunk.pool, DiskPool):
            raise ValueError(f"{chunk!r} is not on disk")
        return chunk.pool

    def _page_io(self, chunk: Chunk, first: int, count: int, submit: Callable, make: Callable) -> Handle:
        return self._joined([(submit, make(i, e)) for i, e in enumerate(chunk.extents[first : first + count])])

    def _joined(self, parts: list) -> Handle:
        """One handle for ``parts`` (submit, work) run on their workers: done when all are."""
        handle = Handle()
        join = _Join(len(parts), handle._finish)
        if not parts:
            handle._finish(None)
        self._submit(parts, join)
        return handle

    @staticmethod
    def _submit(parts: list, join: _Join) -> None:
        for submit, fn in parts:
            submit(fn).add_done_callback(join.part_done)

    def _read_disk(self, fn: Callable[[], None]) -> Future:
        return self._io.submit(fn, READ)

    def _write_disk(self, fn: Callable[[], None]) -> Future:
        return self._io.submit(fn, WRITE)

    def _complete(self, chunk: Chunk, handle: Handle, src: Pool, dst: Pool, extents: list[Extent],
                  error: BaseException | None) -> None:
        with chunk.lock:
            if error is None:
                src.release(chunk.extents)
                self.accounting.sub(src.tier, chunk.kind, chunk.nbytes)
                chunk.pool, chunk.extents = dst, extents
            else:
                dst.release(extents)
                self.accounting.sub(dst.tier, chunk.kind, chunk.nbytes)
            chunk.pending = None
        handle._finish(error)

    def _parts(self, chunk: Chunk, src: Pool, dst: Pool, extents: list[Extent]) -> list:
        event = self._compute_event()
        if isinstance(dst, DiskPool):
            return [(self._write_disk, self._writer(chunk, src, dst, e, i * dst.page_size, event))
                    for i, e in enumerate(extents)]
        target = Chunk(chunk.name, chunk.kind, chunk.nbytes, dst, extents)
        if isinstance(src, DiskPool):
            return [(self._read_disk, self._reader(target, src, e, i * src.page_size, event))
                    for i, e in enumerate(chunk.extents)]
        return [(self._copy.submit, lambda: self._on_copy_stream(dst.tier, event, lambda: self._scatter(
            target, 0, chunk, 0, chunk.nbytes)))]

    def _compute_event(self) -> "torch.cuda.Event | None":
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def _on_copy_stream(self, dst_tier: Tier, event: "torch.cuda.Event | None", copy: Callable[[], None]) -> None:
        """Run ``copy`` on the h2d or d2h stream after ``event``; return when it is complete."""
        stream = self._streams.get("h2d" if dst_tier is Tier.DEVICE else "d2h")
        if stream is None:
            copy()
            return
        with torch.cuda.stream(stream):
            if event is not None:
                stream.wait_event(event)
            copy()
        stream.synchronize()  # the copy worker waits, never the compute stream

    @staticmethod
    def _scatter(dst: Chunk, dst_start: int, src: Chunk, src_start: int, n: int) -> None:
        """Copy src bytes [src_start, +n) to dst bytes [dst_start, +n) across both extent lists."""
        pieces = [(pos - src_start, src.pool.view(e)) for pos, e in src.segments(src_start, src_start + n)]
        for pos, e in dst.segments(dst_start, dst_start + n):
            out = dst.pool.view(e)
            rel = pos - dst_start
            for s_rel, s_view in pieces:
                lo, hi = max(rel, s_rel), min(rel + e.length, s_rel + s_view.numel())
                if lo < hi:
                    _copy(out[lo - rel : hi - rel], s_view[lo - s_rel : hi - s_rel])

    def _staging(self, size: int) -> torch.Tensor:
        """A per-worker aligned (pinned with CUDA) host buffer of one page."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < size:
            buf, self._local.region = host_buffer(size, pin=self._cuda)
            self._local.buf = buf
        return buf

    def _writer(self, chunk: Chunk, src: Pool, disk: DiskPool, e: Extent, start: int,
                event: "torch.cuda.Event | None") -> Callable[[], None]:
        def write() -> None:
            n = e.length
            padded = -(-n // IO_ALIGN) * IO_ALIGN
            direct = self._direct_view(src, chunk, start, n, padded)
            if direct is None:
                stage = self._staging(disk.page_size)
                self._on_copy_stream(Tier.HOST, event, lambda: self._gather(stage, chunk, start, n))
                stage[n:padded].zero_()
                direct = stage[:padded]
            disk.write_page(e.page, memoryview(direct.numpy()))
        return write

    def _reader(self, target: Chunk, disk: DiskPool, e: Extent, start: int,
                event: "torch.cuda.Event | None") -> Callable[[], None]:
        """A page read and put in place: on a GPU, after ``event`` (kernels queued before the read was
        asked for may still read the bytes it overwrites)."""
        def read() -> None:
            direct = self._direct_view(target.pool, target, start, e.length, disk.written_length(e.page))
            if direct is not None:  # straight into place; a bad checksum fails the whole move/copy
                disk.read_page(e.page, memoryview(direct.numpy()))
                return
            stage = self._staging(disk.page_size)
            disk.read_page(e.page, memoryview(stage.numpy()))  # verified before any byte is used
            self._on_copy_stream(target.tier, event, lambda: self._scatter_from(target, start, stage[: e.length]))
        return read

    @staticmethod
    def _direct_view(pool: Pool, chunk: Chunk, start: int, n: int, padded: int) -> torch.Tensor | None:
        """The source bytes themselves when O_DIRECT can use them as they are (no staging copy).

        Only when the length is already aligned: rounding up would write (and checksum) bytes
        past the chunk's end, which belong to whatever shares the page and may change meanwhile."""
        if n != padded or not isinstance(pool, MemoryPool) or pool.device.type != "cpu":
            return None
        segs = list(chunk.segments(start, start + n))
        if len(segs) != 1:
            return None
        e = segs[0][1]
        begin = e.page * pool.page_size + e.offset
        if begin % IO_ALIGN or begin + padded > pool.capacity or e.offset + padded > pool.page_size:
            return None
        return pool.buffer[begin : begin + padded]

    @staticmethod
    def _gather(stage: torch.Tensor, chunk: Chunk, start: int, n: int) -> None:
        for pos, e in chunk.segments(start, start + n):
            _copy(stage[pos - start : pos - start + e.length], chunk.pool.view(e))

    @staticmethod
    def _scatter_from(target: Chunk, start: int, data: torch.Tensor) -> None:
        for pos, e in target.segments(start, start + data.numel()):
            _copy(target.pool.view(e), data[pos - start : pos - start + e.length])
