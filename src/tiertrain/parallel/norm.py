"""The global gradient norm when gradients are split over ranks: each rank's pieces' norms, combined
over the ranks by an all-reduce (of squares for a p-norm, of the maximum for the inf-norm)."""

from __future__ import annotations

import math

import torch

from tiertrain.parallel.collectives import Collectives


def sharded_norm(comm: Collectives, pieces: list[torch.Tensor], whole: list[torch.Tensor],
                 norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all ranks' ``pieces`` together with ``whole`` (gradients every rank holds
    alike, counted once)."""
    def norms(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.linalg.vector_norm(t, norm_type) for t in ts]) if ts else torch.zeros(1)

    if math.isinf(norm_type):
        mine = norms(pieces).max().reshape(1).float()
        comm.all_reduce(mine, op="max")
        return torch.maximum(mine[0], norms(whole).max())
    mine = norms(pieces).pow(norm_type).sum().reshape(1).float()
    comm.all_reduce(mine)
    return (mine[0] + norms(whole).pow(norm_type).sum()).pow(1.0 / norm_type)
