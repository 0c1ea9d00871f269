"""How a parameter is initialised when the model was built without memory (the meta device) and
its values are drawn where they will live, chunk by chunk, instead of by the model's own init."""

from __future__ import annotations

import torch


def init_in_place(name: str, out: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """GPT-2 style, directly in ``out`` (no temporary tensor): matrices N(0, 0.02), 1-D
    ``*.weight`` (norm scales) ones, everything else zeros. ``generator``: drawn from it, not torch's own."""
    if out.dim() >= 2:
        out.normal_(0.0, 0.02, generator=generator)
    else:
        out.fill_(1.0 if name.endswith("weight") else 0.0)
