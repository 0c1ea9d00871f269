"""The collectives a block group calls on its chunks, behind one interface.

Flat-tensor calls, as FSDP2's default collectives are: a chunk is already one flat buffer padded
to a multiple of the group size (``ChunkLayout.shard_numel``), so all-gather and reduce-scatter
move it whole, with no per-parameter packing. ``local`` is the one-process case (world 1), where
every collective is the identity; ``distributed`` runs them over a ``torch.distributed`` process
group (gloo on CPU, NCCL on GPUs). Every rank must issue the same collectives in the same order:
the runtime issues them from the thread that runs the step (never from optimizer workers).

Two sides, the same ranks: the collectives themselves take device-tier tensors (chunks in the memory
system's device pool, and activations), what NCCL moves on a GPU machine; their ``host`` takes host
memory (flags, counts, norms, setup's and checkpoints' transfers), over a CPU group (gloo), since NCCL
refuses a host tensor. On a CPU machine both may be one gloo group: ``parallel.placement`` checks,
in the test suite, that each call still gets a tensor of its side.

``sent`` counts the bytes this rank puts on the wire, by the ring algorithms' formulas (an
all-gather or reduce-scatter of B bytes sends (N-1)/N x B, an all-reduce twice that): what
``bench`` and the tests hold against the per-step formulas of DDP, ZeRO-2 and ZeRO-3. An
all-to-all with uneven slices (expert parallel's tokens) counts the rows it sends to other ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Waitable(Protocol):
    def wait(self) -> None: ...


class Collectives(Protocol):
    rank: int
    world_size: int
    sent: int
    host: Collectives  # the same ranks, for host-memory tensors (itself where one group serves both)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Waitable | None:
        """``out`` (world_size x shard's numel) receives every rank's ``shard``, in rank order."""

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Waitable | None:
        """``out`` receives this rank's slice of the sum over ranks of ``full`` (which the call may overwrite:
        it is this rank's own buffer, given up to the reduction). ``async_op``: returns at once, ``out``
        holds the slice once the returned handle's ``wait`` returns."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False) -> Waitable | None:
        """``t`` becomes the sum (or ``max``) over ranks of ``t``, in place (once waited for, with ``async_op``)."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        """Slice ``r`` of ``inp`` goes to rank ``r``; slice ``r`` of ``out`` comes from rank ``r``. Equal
        slices of the flat tensors, or ``in_splits[r]`` / ``out_splits[r]`` rows (along dim 0) each."""

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """``t`` becomes rank ``src``'s ``t``."""

    def close(self) -> None:
        """Stop what the collectives run beside the calls (the heartbeat)."""


def split_bytes(inp: torch.Tensor, in_splits: list[int], rank: int) -> int:
    """Bytes an uneven all-to-all sends to other ranks: every slice but this rank's own."""
    row = inp.shape[1:].numel() * inp.element_size()  # an empty input (nothing to send) has rows too
    return row * (sum(in_splits) - in_splits[rank])


def ring_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over ``nbytes`` (the full tensor) in a ring of ``world``."""
    share = nbytes * (world - 1) // world
    return {"all_gather": share, "reduce_scatter": share, "all_reduce": 2 * share, "all_to_all": share,
            "broadcast": nbytes if world > 1 else 0}[kind]
