"""The global gradient norm when gradients are split over ranks: each rank's pieces' norms, combined
over the ranks that split them by an all-reduce (of squares for a p-norm, of the maximum for the
inf-norm). Pieces may be split over different groups of ranks: sharded blocks' over every rank,
expert parallel's experts over the ranks of one expert group (their replicas hold the same ones)."""

from __future__ import annotations

import math

import torch

from tiertrain.parallel.collectives import Collectives


def sharded_norm(parts: list[tuple[Collectives, list[torch.Tensor]]], whole: list[torch.Tensor],
                 norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of every rank's pieces together with ``whole`` (gradients every rank holds
    alike, counted once). ``parts``: (the ranks a list of pieces is split over, this rank's pieces), each
    all-reduced over its ranks in the order given (every rank gives the same order)."""
    def norms(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.linalg.vector_norm(t, norm_type) for t in ts]) if ts else torch.zeros(1)

    inf = math.isinf(norm_type)
    total = norms(whole).max() if inf else norms(whole).pow(norm_type).sum()
    combined = []
    for comm, pieces in parts:
        mine = (norms(pieces).max() if inf else norms(pieces).pow(norm_type).sum()).reshape(1).float().cpu()
        comm.host.all_reduce(mine, op="max" if inf else "sum")  # one number: over the CPU group
        combined.append(mine[0].to(total.device))
    if inf:
        return torch.stack([*combined, total]).max()
    for c in combined:
        total = c + total
    return total.pow(1.0 / norm_type)
