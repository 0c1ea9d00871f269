"""A disk-homed block's update streamed through host a piece at a time (ANGEL-PTM updates page by page;
DeepSpeed's ``sub_group_size``), so the host holds a few pieces instead of the block's whole states:
one block's fp32 master and moments are 12 B per parameter, and the largest block (often the
embeddings with the head) would otherwise set the host budget whatever the disk holds.

Per piece (a run of the state chunks' pages, the same pages of master and both moments): its pages
are read into host buffers, AdamW runs on the parameters' parts inside it with the gradients' same
part (the gradients wait on the device: ``plan.bytes.grad_tier``), the new compute params are
published, and the pages are written back in place. Three buffer sets per update: the next piece is
read while this one is updated and the last one written. The fused kernel is elementwise, so cutting
parameters into pieces changes no bit; each parameter's step count is advanced once, after its last
piece (the kernel advances the copy each piece is given).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tiertrain.memory import MemorySystem, Tier
from tiertrain.memory.chunk import Chunk
from tiertrain.memory.movement import Handle
from tiertrain.optim import AdamWHyper, adamw_step
from tiertrain.plan import BlockPlan
from tiertrain.plan.bytes import PIECE_BUFFERS, piece_bytes
from tiertrain.runtime.grads import TakenGrads

F32 = torch.float32


class PiecewiseGroup(Protocol):
    """What an update in pieces reads of a block group (``runtime.block_group``, which calls it)."""

    block: Any
    plan: BlockPlan
    mem: MemorySystem
    compute: torch.dtype
    master: Chunk
    param_home: Chunk | None
    slot: Any
    steps: list[torch.Tensor]
    group_of: list[int]
    view_params: list[int]
    state_cuts: list[tuple[int, int]]
    state_numel: int
    states: tuple[Chunk, Chunk, Chunk]
    on_disk: list[Chunk]

    def steps_on(self, device: torch.device) -> None: ...


class _Buffers:
    """One piece's host buffers for each state on disk, allocated from the host pool (so the budget
    counts them), each starting on a page boundary (O_DIRECT reads straight into them). A state
    on the host (a ``host_master`` block's master) is updated where it lies: its piece is a view."""

    def __init__(self, g: PiecewiseGroup, nbytes: int) -> None:
        self.held: list[tuple[Chunk, Chunk]] = []  # (a disk state, its host buffer)
        self.bytes: list[torch.Tensor] = []        # per state (master, exp_avg, exp_avg_sq): this piece's bytes
        self.io: list[Handle] = []                 # its reads or its write-back in flight
        try:
            for c in g.on_disk:
                self.held.append((c, g.mem.allocate(f"{g.block.name}.piece", nbytes, Tier.HOST, c.kind,
                                                    contiguous=True)))
        except BaseException:
            self.release(g.mem)  # a refusal frees the buffers already made
            raise

    def at(self, g: PiecewiseGroup, first: int, count: int) -> None:
        """Point the buffers at pages ``[first, first + count)``: a host state's bytes are its own."""
        page, mine = self.held[0][0].pool.page_size, {id(c): b.merge() for c, b in self.held}

        def piece(c: Chunk) -> torch.Tensor:
            return mine[id(c)] if id(c) in mine else c.merge()[first * page : (first + count) * page]
        self.bytes = [piece(c) for c in g.states]

    def on_disk(self, g: PiecewiseGroup) -> list[tuple[Chunk, torch.Tensor]]:
        """(disk state, this piece's bytes of it) for each state on disk."""
        mine = {id(c) for c, _ in self.held}
        return [(c, b) for c, b in zip(g.states, self.bytes) if id(c) in mine]

    def wait(self) -> None:
        for h in self.io:
            h.wait()
        self.io = []

    def release(self, mem: MemorySystem) -> None:
        for _, b in self.held:
            mem.release(b)
        self.held = []


def update_in_pieces(g: PiecewiseGroup, taken: TakenGrads, hypers: list[AdamWHyper], coef: torch.Tensor | None) -> None:
    """The AdamW step of a block whose states stay on disk (``plan.bytes.in_pieces``) with the gradients
    it took, its new params published a piece at a time (the group notes the step they include)."""
    hypers = taken.hypers or hypers  # lockfree keeps each step's own with its gradients
    disk = g.on_disk[0]  # disk chunks: one extent per page
    mem, page = g.mem, disk.pool.page_size
    per_piece = max(1, piece_bytes(disk.nbytes, g.plan) // page)
    n_pages = len(disk.extents)
    firsts = list(range(0, n_pages, per_piece))
    g.steps_on(torch.device("cpu"))  # updated on the host (a replan may have homed it on the GPU before)
    before = [s.detach().clone() for s in g.steps]
    sets: list[_Buffers] = []
    try:
        for _ in range(min(PIECE_BUFFERS, len(firsts))):  # in the try: a refusal frees those already made
            sets.append(_Buffers(g, min(per_piece, n_pages) * page))
        _read(g, sets[0], firsts[0], per_piece)
        for k, first in enumerate(firsts):
            buf = sets[k % len(sets)]
            if k + 1 < len(firsts):
                nxt = sets[(k + 1) % len(sets)]
                nxt.wait()  # its last write-back landed: the buffers are free again
                _read(g, nxt, firsts[k + 1], per_piece)
            buf.wait()
            lo = first * page // F32.itemsize
            _adamw_piece(g, buf, lo, hypers, coef, taken, before)
            _publish_piece(g, buf, lo)
            buf.io = [mem.mover.write_pages(c, first, per_piece, b) for c, b in buf.on_disk(g)]
        for s in sets:
            s.wait()
    finally:
        for s in sets:
            _drain(s)
            s.release(mem)
        mem.release(taken.chunk)  # gradients live from backward's flush to here, whatever happened
    for i, s in enumerate(g.steps):
        if taken.has_grad[i]:
            s.copy_(before[i] + 1)


def _read(g: PiecewiseGroup, buf: _Buffers, first: int, count: int) -> None:
    buf.at(g, first, count)
    buf.io = [g.mem.mover.read_pages(c, first, count, b) for c, b in buf.on_disk(g)]


def _drain(buf: _Buffers) -> None:
    """Let whatever a failed update left in flight land before its buffers go back to the pool."""
    for h in buf.io:
        try:
            h.wait()
        except Exception:  # noqa: BLE001 - the update's own error is the one raised
            pass


def _cut(g: PiecewiseGroup, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(parameter, start, end) of each parameter part inside state elements ``[lo, hi)``."""
    out = []
    for owner, (a, b) in zip(g.view_params, g.state_cuts):
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((owner, a, b))
    return out


def _adamw_piece(g: PiecewiseGroup, buf: _Buffers, lo: int, hypers: list[AdamWHyper], coef: torch.Tensor | None,
                 taken: TakenGrads, before: list[torch.Tensor]) -> None:
    """AdamW on the parameter parts inside this piece, each from its step count before the update."""
    n = buf.bytes[0].numel() // F32.itemsize
    parts = _cut(g, lo, min(lo + n, g.state_numel))
    if not parts:
        return
    master, m, v = (b.view(F32) for b in buf.bytes)
    grads = taken.chunk.typed(F32)
    adamw_step([master[a - lo : b - lo] for _, a, b in parts], [grads[a:b] for _, a, b in parts],
               [m[a - lo : b - lo] for _, a, b in parts], [v[a - lo : b - lo] for _, a, b in parts],
               [before[i].clone() for i, _, _ in parts], [taken.has_grad[i] for i, _, _ in parts],
               [g.group_of[i] for i, _, _ in parts], hypers, coef)


def _publish_piece(g: PiecewiseGroup, buf: _Buffers, lo: int) -> None:
    """The piece's new params into the compute copy the next forward reads; where that copy is the
    fp32 master itself (on disk), its write-back publishes it."""
    target: Chunk = g.param_home if g.param_home is not None else g.slot.chunk
    if target is g.master:
        return
    n = min(buf.bytes[0].numel() // F32.itemsize, g.state_numel - lo)
    target.typed(g.compute)[lo : lo + n].copy_(buf.bytes[0].view(F32)[:n])
