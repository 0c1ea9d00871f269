"""A weight two pipeline stages share: a tied embedding, used by the first stage's embedding and the last
stage's head (Megatron's "embedding group").

Each of the two stages holds the weight (the last a copy, ``models.gpt_stages.TiedCopy``) and makes its own
share of the gradient; before every step the two shares are summed, so both stages update the weight alike
and it stays one weight. Per replica of the pipeline, the pair of ranks holding its first and last stage
sum them over a gloo group of their own, a slice at a time (the host never holds a whole copy of a
vocabulary-sized gradient); where a stage's states are sharded over its data-parallel replicas, each slice
is first gathered over them (each rank's piece in place, zeros elsewhere, summed: exact) and each keeps its
piece of the sum. The copy's side leaves the weight out of its norm, so the pipeline's norm counts it once.
In one process autograd adds the head's and the embedding's gradient per micro-batch; here each stage sums
its micro-batches first: the same terms in another order.

Why by hand: torch's pipelining has no notion of a parameter shared between stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.distributed import ProcessGroupCollectives
from tiertrain.parallel.health import Heartbeat

SLICE = 4 << 20  # elements summed at a time (16 MiB of fp32)


class HoldsGrads(Protocol):
    """What a stage's runtime offers (``runtime.Runtime``)."""

    def grad_piece(self, param: nn.Parameter) -> tuple[torch.Tensor | None, int, bool]: ...
    def leave_out_of_norm(self, param: nn.Parameter) -> None: ...


@dataclass
class TiedStages:
    """This rank's side of a tied weight: ``runtime`` (its stage's) holds ``param``."""

    pair: Collectives       # the pipeline's first- and last-stage ranks (gloo)
    stage_dp: Collectives   # the stage's data-parallel group (its ``host`` side)
    runtime: HoldsGrads
    param: nn.Parameter
    _part: torch.Tensor = field(init=False, repr=False)  # one slice's buffer, kept for every step

    def __post_init__(self) -> None:
        self._part = torch.empty(min(SLICE, self.param.numel()), dtype=torch.float32)

    def sum_grads(self) -> None:
        """The two stages' gradients of the weight summed into each (every reduction of theirs landed first)."""
        piece, start, sharded = self.runtime.grad_piece(self.param)
        end = start + (piece.numel() if piece is not None else 0)
        n = self.param.numel()
        for lo in range(0, n, SLICE):
            hi = min(n, lo + SLICE)
            part = self._part[: hi - lo].zero_()
            a, b = max(lo, start), min(hi, end)  # this rank's piece within the slice
            if a < b:
                part[a - lo : b - lo].copy_(piece[a - start : b - start])
            if sharded:  # the stage's pieces of the slice, on its data-parallel ranks (disjoint, zeros elsewhere)
                self.stage_dp.host.all_reduce(part)
            self.pair.all_reduce(part)
            if a < b:
                piece[a - start : b - start].copy_(part[a - lo : b - lo])


def pair_groups(pp: int, dp: int, heartbeat: Heartbeat) -> tuple[Collectives | None, list[dist.ProcessGroup]]:
    """Every pipeline's (first stage, last stage) pair of ranks as a gloo group, made by every rank in one
    order; this rank's (None where it holds neither end) and every group made (destroyed at close)."""
    mine, made = None, []
    me = dist.get_rank()
    for replica in range(dp):
        ranks = [replica * pp, replica * pp + pp - 1]
        group = dist.new_group(ranks, backend="gloo")
        made.append(group)
        if me in ranks:
            mine = ProcessGroupCollectives(group, heartbeat=heartbeat)
    return mine, made
