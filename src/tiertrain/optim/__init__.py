"""AdamW and clipping arithmetic over tensors. Imports nothing of the runtime or the memory layer."""

from tiertrain.optim.adamw import adamw_step
from tiertrain.optim.clip import clip_coefficient, total_norm
from tiertrain.optim.hparams import AdamWHyper

__all__ = ["AdamWHyper", "adamw_step", "clip_coefficient", "total_norm"]
