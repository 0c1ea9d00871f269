"""The memory layer's one entry point: three pools, the mover and the accounting."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tiertrain.memory.accounting import Accounting
from tiertrain.plan.budgets import Budgets
from tiertrain.memory.capacity import check_budgets
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.disk import DiskDir, DiskPool
from tiertrain.memory.movement import Handle, Mover, landed
from tiertrain.memory.pool import DEFAULT_PAGE_SIZE, IO_ALIGN, MemoryPool, Pool, check_page_size, host_buffer
from tiertrain.plan.tiers import Kind, Tier


def compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class MemorySystem:
    """Pools reserved once from ``budgets``; chunks allocated, moved and released by the caller.

    Use as a context manager (or call ``close``): disk files are removed at the end, and a
    run killed before that has its files removed by the next run using the same directory.
    """

    def __init__(self, budgets: Budgets, page_size: int = DEFAULT_PAGE_SIZE, io_workers: int = 8,
                 device: torch.device | None = None, reserve_disk: bool = True, check_machine: bool = True,
                 write_share: int = 0, device_reserve: int | None = None) -> None:
        """``check_machine=False``: the caller has already held the budgets against the machine
        (``tiertrain.setup`` does, before it profiles or builds anything). ``io_workers``: disk requests
        in flight; ``write_share``: how many of them may write while reads wait (runs measure both per
        disk: ``engine.measure.disk_depth``). ``device_reserve``: the device pool maps only this much of
        its budget (whole pages), what the plan counts for it (``tiertrain.setup``): on a GPU torch
        allocates activations beside the pool, and the planner counted them in the same budget, so a
        pool of the whole budget put them on top of it (an H100 run at a 512 MiB budget peaked at
        1.14 GiB)."""
        self.device = device or compute_device()
        self.closed = False
        budgets.check_disk_dir()
        if check_machine:
            check_budgets(budgets, self.device)
        self.page_size = check_page_size(page_size)  # runs measure theirs (engine.measure.page_size)
        self.accounting = Accounting()
        self.pools: dict[Tier, Pool] = {
            Tier.DEVICE: MemoryPool(Tier.DEVICE, budgets.device, self.page_size, self.device, device_reserve),
            Tier.HOST: MemoryPool(Tier.HOST, budgets.host, self.page_size, torch.device("cpu")),
        }
        if budgets.disk:
            self.pools[Tier.DISK] = DiskPool(budgets.disk, self.page_size, DiskDir(budgets.disk_dir),
                                             reserve=reserve_disk)
        self.mover = Mover(self.pools, self.accounting, io_workers=io_workers, write_share=write_share)

    def __enter__(self) -> "MemorySystem":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pool(self, tier: Tier) -> Pool:
        if tier not in self.pools:
            raise ValueError(f"no {tier.value} tier in this run; give it a budget (--disk DIR:SIZE)")
        return self.pools[tier]

    def allocate(self, name: str, nbytes: int, tier: Tier, kind: Kind = Kind.OTHER, contiguous: bool = False,
                 top: bool = False) -> Chunk:
        """A chunk of ``nbytes`` on ``tier``. ``contiguous``: one run of whole pages, so typed views
        need no merge (what the runtime wants for every state it computes on); ``top``: the last such
        run (``pages.PageTable.allocate``)."""
        pool = self.pool(tier)
        chunk = Chunk(name, kind, nbytes, pool, pool.allocate(nbytes, contiguous, top))
        self.accounting.add(tier, kind, nbytes)
        return chunk

    def tier_of(self, t: torch.Tensor) -> Tier | None:
        """The memory pool ``t`` lies in (None: outside the device and host pools): what
        ``parallel.placement`` holds each collective's tensors to, on a CPU machine too."""
        if t.numel() == 0:
            return None
        ptr = t.data_ptr()
        for tier in (Tier.DEVICE, Tier.HOST):
            buf = self.pools[tier].buffer
            if buf.device == t.device and buf.numel() and buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel():
                return tier
        return None

    def from_tensor(self, name: str, tensor: torch.Tensor, tier: Tier, kind: Kind = Kind.OTHER) -> Chunk:
        """A chunk holding ``tensor``'s bytes, on any tier (disk is written and waited for)."""
        data = _bytes_of(tensor)
        chunk = self.allocate(name, data.numel(), tier, kind)
        self.overwrite(chunk, data)
        return chunk

    def overwrite(self, chunk: Chunk, data: torch.Tensor) -> None:
        """Replace every byte of ``chunk`` with ``data``'s, where the chunk lies. A disk chunk's pages
        are written directly, without reading what they held (a move to the host and back read it
        all first, and needed host room for it)."""
        data = _bytes_of(data)
        if data.numel() != chunk.nbytes:
            raise ValueError(f"{chunk.name}: {data.numel()} bytes given for a chunk of {chunk.nbytes}")
        if chunk.tier is not Tier.DISK:
            offset = 0
            for view in chunk.views():
                view.copy_(data[offset : offset + view.numel()])
                offset += view.numel()
            return
        self.write_parts(chunk, [(0, data)])

    def zero(self, chunk: Chunk) -> None:
        """Zero every byte of ``chunk`` where it lies (a disk chunk a page at a time: no chunk-sized buffer)."""
        if chunk.tier is not Tier.DISK:
            for view in chunk.views():
                view.zero_()
            return
        self.write_parts(chunk, [])

    def write_parts(self, chunk: Chunk, parts: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Write a chunk in place from ``parts``, (byte offset, bytes) in increasing order without
        overlaps, bytes no part covers zeroed: a block's weights go to disk a parameter at a time,
        never whole in memory (each page once, through one aligned page buffer)."""
        if chunk.tier is not Tier.DISK:
            flat = chunk.merge()
            flat.zero_()
            for offset, data in parts:
                data = _bytes_of(data)
                flat[offset : offset + data.numel()].copy_(data)
            return
        disk = self.pool(Tier.DISK)
        assert isinstance(disk, DiskPool)
        ps = disk.page_size
        stage, region = host_buffer(ps, pin=False)  # O_DIRECT needs an aligned buffer
        pages = chunk.extents  # disk chunks: one extent per page, each from its start (e.offset == 0)
        done = 0

        def flush_until(i: int) -> None:
            nonlocal done
            while done < i:
                e = pages[done]
                padded = -(-e.length // IO_ALIGN) * IO_ALIGN
                stage[e.length : padded].zero_()
                disk.write_page(e.page, memoryview(stage[:padded].numpy()))
                stage.zero_()
                done += 1

        stage.zero_()
        for offset, data in parts:
            data = _bytes_of(data)
            pos = 0
            while pos < data.numel():
                at = offset + pos
                flush_until(at // ps)
                n = min(data.numel() - pos, (at // ps + 1) * ps - at)
                stage[at % ps : at % ps + n] = data[pos : pos + n]
                pos += n
        flush_until(len(pages))
        del stage, region

    def to_tensor(self, chunk: Chunk) -> torch.Tensor:
        """A CPU copy of the chunk's bytes (uint8); a disk chunk is read where it lies (verified)."""
        if chunk.tier is Tier.DISK:  # read where it lies: moving it to the host and back (as this once did)
            return self.read_range(chunk, 0, chunk.nbytes)  # wrote every byte again (8.4 s of a 28 s save)
        return torch.cat([v.cpu() for v in chunk.views()]) if chunk.nbytes else torch.empty(0, dtype=torch.uint8)

    def landed(self, chunk: Chunk) -> Chunk:
        """``chunk`` once a move of it under way has landed (its tier is then where it lies)."""
        landed(chunk)
        return chunk

    def read_into_async(self, chunk: Chunk, out: torch.Tensor) -> Handle:
        """A disk chunk's bytes into ``out`` (uint8, as many as it holds), page by page on the read workers:
        its handle's ``wait`` returns once every page has landed (or raises a short read, a bad checksum)."""
        return self.mover.read_into(chunk, out)

    def read_range(self, chunk: Chunk, start: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` of a disk chunk, as a CPU tensor of their own (verified):
        reading one parameter of a large block costs that parameter, not the block, and its pages are
        read by the I/O workers together, as a whole chunk's are (a checkpoint reads every state so)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        ps = self.pool(Tier.DISK).page_size  # a disk chunk's extents are whole pages, in order
        first, last = start // ps, (start + nbytes - 1) // ps
        pages, _ = host_buffer((last - first + 1) * ps, pin=False)  # aligned for O_DIRECT; the view keeps it
        self.mover.read_pages(chunk, first, last - first + 1, pages).wait()
        return pages[start - first * ps : start - first * ps + nbytes]

    def move(self, chunk: Chunk, tier: Tier, contiguous: bool = False) -> Handle:
        self.pool(tier)
        return self.mover.move(chunk, tier, contiguous)

    def move_from(self, chunk: Chunk, tier: Tier, source: Chunk, contiguous: bool = False) -> Handle:
        """``chunk`` to ``tier`` with its bytes copied from ``source`` (which holds them), not read from
        where it lies, asynchronously: the caller writes ``source`` again only once the handle is done
        (``Mover.move_from``)."""
        self.pool(tier)
        return self.mover.move_from(chunk, tier, source, contiguous)

    def release(self, chunk: Chunk) -> None:
        with chunk.lock:
            chunk.check_usable()
            chunk.pool.release(chunk.extents)
            self.accounting.sub(chunk.tier, chunk.kind, chunk.nbytes)
            chunk.released = True
            chunk.extents = []

    def disk_traffic(self) -> dict[str, int]:
        """Bytes the disk tier has read and written so far (``read``, ``written``; 0 without a disk), as
        whole 4 KiB sectors: what the disk moved, which the planner's simulator predicts per step."""
        disk = self.pools.get(Tier.DISK)
        read, written = disk.traffic() if isinstance(disk, DiskPool) else (0, 0)
        return {"read": read, "written": written}

    def stats(self) -> dict[str, Any]:
        """Per tier: budget, bytes its pool maps (``reserved_bytes``; the device pool's may be less
        than its budget), page bytes in use, and live/peak bytes per state kind; for the disk also the
        bytes it has read and written."""
        report = self.accounting.report()
        for tier, pool in self.pools.items():
            report[tier.value].update(budget=pool.budget, reserved_bytes=pool.capacity,
                                      pages_in_use_bytes=pool.used_bytes, pages_peak_bytes=pool.peak_bytes,
                                      page_size=pool.page_size)
        if Tier.DISK in self.pools:
            traffic = self.disk_traffic()
            report[Tier.DISK.value].update(bytes_read=traffic["read"], bytes_written=traffic["written"])
        return report

    def close(self) -> None:
        """The movers stopped, the pools given back and the disk files removed (once; again does nothing)."""
        if self.closed:
            return
        self.closed = True
        self.mover.close()
        for pool in self.pools.values():
            pool.close()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat uint8 on the CPU (a view where it already is one)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()
