"""Where block updates run: inline (``sync``) or on worker threads while the device computes
(``overlap``, STRONGHOLD's concurrent CPU optimizers).

An update reads the block's states home to the host when they live on disk, runs AdamW,
writes the new compute params where the next forward reads them, and sends the states
home again. Two workers let one block's disk I/O overlap another block's arithmetic.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from tiertrain.errors import BudgetError
from tiertrain.memory import MemorySystem, Tier
from tiertrain.optim.adamw import adamw_block
from tiertrain.runtime.block_state import BlockState, publish


class Pending:
    """An update in flight; ``wait`` re-raises its error in the waiting thread."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()

    def done(self) -> bool:
        return self.future.done()


class Updater:
    def __init__(self, mem: MemorySystem, groups: list[dict[str, Any]], on_params_written: Callable[[BlockState], None],
                 workers: int = 2, read_ahead: int = 2) -> None:
        self.mem, self.groups, self.on_params_written = mem, groups, on_params_written
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tiertrain-optim")
        self._home_moves: dict[int, list] = {}
        self._reads: dict[int, list] = {}       # block index -> reads from disk in flight
        self._local = threading.local()         # per worker: its last write-back to disk
        self._lock = threading.Lock()
        self.max_read_ahead = read_ahead        # blocks whose disk states are read in before their update

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def read_ahead(self, st: BlockState, block: bool = True) -> bool:
        """Start reading a disk-homed block's states now (its backward begins), so the reads
        overlap the backward of this and later blocks instead of following it (ANGEL-PTM's
        trigger points). Skipped when ``max_read_ahead`` blocks are already read in, and, with
        ``block=False``, while the block's last update or its write-back is still running (a
        forward-time trigger must never make the forward wait). True once its reads are under way
        (or there is nothing to read)."""
        if st.plan.home is not Tier.DISK or st.master is None:
            return True
        if not block and not self._settled(st):
            return False
        with self._lock:
            if st.index in self._reads:
                return True
            if len(self._reads) >= self.max_read_ahead:
                return False
            self._reads[st.index] = []
        for h in self._home_moves.pop(st.index, []):
            h.wait()  # the last update's write-back must land before we read the states again
        reads = []
        try:
            for c in (st.master, st.exp_avg, st.exp_avg_sq):
                reads.append(self.mem.move(c, Tier.HOST, contiguous=True))
        except BudgetError:  # no room now: the update reads what is still on disk itself
            pass
        with self._lock:
            self._reads[st.index] = reads
        return True

    def reading_full(self) -> bool:
        """Whether ``max_read_ahead`` blocks are already read in (a further read_ahead does nothing)."""
        with self._lock:
            return len(self._reads) >= self.max_read_ahead

    def _settled(self, st: BlockState) -> bool:
        pending = st.pending_update
        return ((pending is None or pending.done())
                and all(h.done() for h in self._home_moves.get(st.index, [])))

    def update(self, st: BlockState, clip_coef: torch.Tensor | None,
               groups: list[dict[str, Any]] | None = None) -> None:
        """Update one block now, in this thread, with ``groups`` (default: the current hyperparameters;
        lockfree gradients carry those of the latest step they include)."""
        last = getattr(self._local, "writeback", None)
        if last is not None:  # one write-back per worker in flight bounds the states held in host
            for h in last:
                h.wait()
        with self._lock:
            reads = self._reads.get(st.index, [])
        if not reads:
            for h in self._home_moves.pop(st.index, []):
                h.wait()
        for h in reads:
            h.wait()
        for h in [self.mem.move(c, Tier.HOST, contiguous=True)
                  for c in (st.master, st.exp_avg, st.exp_avg_sq) if c.tier is Tier.DISK]:
            h.wait()
        taken = st.take_grads()
        if taken is not None:
            adamw_block(st, taken.groups or groups or self.groups, clip_coef, taken.chunk, taken.has_grad)
            self.mem.release(taken.chunk)  # gradients live from backward's flush to here
        self._write_params(st)
        if taken is not None:
            st.version = max(st.version, taken.step + 1)
        if st.plan.home is Tier.DISK:
            moves = [self.mem.move(c, Tier.DISK) for c in (st.master, st.exp_avg, st.exp_avg_sq)]
            self._home_moves[st.index] = moves
            self._local.writeback = moves
        with self._lock:
            self._reads.pop(st.index, None)

    def submit(self, st: BlockState, clip_coef: torch.Tensor | None) -> Pending:
        """Update one block on a worker; the block's next use waits on the returned Pending.

        The hyperparameters are copied now: by the time the worker runs, the training loop
        may already have set the next step's learning rate."""
        groups = [dict(g) for g in self.groups]
        pending = Pending(self._pool.submit(self.update, st, clip_coef, groups))
        st.pending_update = pending
        return pending

    def submit_loop(self, st: BlockState, coalesce: int = 1) -> None:
        """Lockfree (ANGEL-PTM Alg. 2): keep updating the block while its gathered gradients span
        ``coalesce`` steps or more; start a loop only if none runs. The device never waits here.

        ``coalesce`` = the plan's max staleness for disk-homed blocks: a block whose params may lag
        N steps needs a pass only every N steps, and each pass costs the same disk traffic whatever
        it carries. Loops that ran flat out instead kept the disk saturated and the cores busy,
        taking about one step of gradients per pass. (``Runtime.params_ready`` forces a pass with ``coalesce=1`` when a
        block would otherwise be staler than allowed, and so does ``wait_updates``.)"""
        with st.lock:
            if st.running or not _due(st, coalesce):
                return
            st.running = True

        def loop() -> None:
            while True:
                self.update(st, None, [dict(g) for g in self.groups])
                with st.lock:
                    if not _due(st, coalesce):
                        st.running = False
                        return

        st.pending_update = Pending(self._pool.submit(loop))

    def settle_block(self, st: BlockState) -> None:
        """Return once the block's params are final (before reading them): its update is done and,
        where its slot is filled from the fp32 master itself, the master's write-back has landed.

        Other blocks' params were published before the write-back began (a host param home or
        their device slot), so the next forward runs while their states go home to disk: that
        write-back overlaps compute instead of the forward waiting for it. The states' next
        reader (``read_ahead``, ``update``) waits for it instead."""
        if st.pending_update is not None:
            st.pending_update.wait()
        if st.fills_slot_from_master:
            for h in self._home_moves.pop(st.index, []):
                h.wait()

    def drain(self) -> None:
        """Wait for every write-back to disk (before checkpoints or closing)."""
        for moves in self._home_moves.values():
            for h in moves:
                h.wait()
        self._home_moves.clear()

    def _write_params(self, st: BlockState) -> None:
        target = st.param_home if st.param_home is not None else st.slot.chunk
        if target is not st.master:  # an fp32 master doubles as the param home of a streamed block
            publish(st.master, target, st.layout, st.compute)
        self.on_params_written(st)


def _due(st: BlockState, coalesce: int) -> bool:
    """Whether the block's gathered gradients span ``coalesce`` steps (call under ``st.lock``)."""
    return st.grad is not None and st.grad_step + 1 - st.version >= coalesce
