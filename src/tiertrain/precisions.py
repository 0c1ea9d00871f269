"""The compute precisions a run may use, defined once: their names, bytes per element, torch dtypes.

Importing this loads no torch (the planner, which must not, reads the bytes); ``torch_dtype``
imports it when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16", "fp16")
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a precision name (``fp32``, ``bf16``, ``fp16``)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
