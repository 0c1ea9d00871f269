"""A weight two pipeline stages share: a tied embedding, used by the first stage's embedding and the last
stage's head (Megatron's "embedding group").

Each of the two stages holds the weight (the last a copy, ``models.gpt_stages.TiedCopy``) and makes its own
share of the gradient; before every step the two shares are summed, so both stages update the weight alike
and it stays one weight. Per replica of the pipeline, the pair of ranks holding its first and last stage
sum them over a gloo group of their own; where a stage's states are sharded over its data-parallel replicas,
its pieces are gathered first (each rank's piece in place, zeros elsewhere, summed: the gather exact) and
each keeps its piece of the sum. In one process autograd adds the head's and the embedding's gradient per
micro-batch; here each stage sums its micro-batches first: the same terms in another order.

Why by hand: torch's pipelining has no notion of a parameter shared between stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.distributed import ProcessGroupCollectives


@dataclass
class TiedStages:
    """This rank's side of a tied weight: ``runtime`` (the stage's) holds ``param``; ``copy``: the last
    stage's side, whose norm leaves the weight out (the first stage's counts it once)."""

    pair: Collectives       # the pipeline's first- and last-stage ranks (gloo)
    stage_dp: Collectives   # the stage's data-parallel group (its ``host`` side)
    runtime: object         # the stage's ``Runtime`` (``grad_piece``)
    param: nn.Parameter
    copy: bool
    _summed: torch.Tensor | None = None  # the weight's summed gradient, whole, this step

    def sum_grads(self) -> None:
        """The two stages' gradients of the weight summed into each (every reduction of theirs landed first)."""
        found = self.runtime.grad_piece(self.param)  # type: ignore[attr-defined]
        full = torch.zeros(self.param.numel(), dtype=torch.float32)
        piece, start, sharded = found if found is not None else (None, 0, True)
        if piece is not None:
            full[start : start + piece.numel()] = piece.detach().to("cpu")
        if sharded:  # the stage's pieces of it, on its data-parallel ranks: gathered (disjoint, zeros elsewhere)
            self.stage_dp.host.all_reduce(full)
        self.pair.all_reduce(full)
        if piece is not None:
            piece.copy_(full[start : start + piece.numel()])
        self._summed = full

    def stage_norm(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """This stage's gradient norm as the pipeline's global norm should count it: the copy's side without
        the weight (the first stage's side counts it), so the pipeline counts it once as one process does."""
        if not self.copy or self._summed is None or math.isinf(norm_type):  # a maximum counts it once either way
            return norm
        p = float(norm_type)
        rest = max(float(norm) ** p - float(self._summed.norm(p)) ** p, 0.0)
        return torch.tensor(rest ** (1 / p), dtype=norm.dtype)

    def end_step(self) -> None:
        self._summed = None


def pair_groups(pp: int, dp: int, heartbeat) -> tuple[Collectives | None, list[dist.ProcessGroup]]:
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
