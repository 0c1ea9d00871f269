"""Process groups and the collectives block groups call on their chunks. One process is the case
world = 1 of the same code (``LocalCollectives``); ``ProcessGroupCollectives`` runs them over
``torch.distributed``."""

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.local import LocalCollectives

__all__ = ["Collectives", "LocalCollectives", "collectives_for"]


def collectives_for(world_size: int) -> Collectives:
    """The collectives of a plan's layout: the identity for one process; over the default
    ``torch.distributed`` group otherwise (it must be initialised, with that many ranks)."""
    if world_size == 1:
        return LocalCollectives()
    import torch.distributed as dist

    from tiertrain.parallel.distributed import ProcessGroupCollectives

    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise RuntimeError(f"a plan over {world_size} processes needs torch.distributed initialised with that many")
    return ProcessGroupCollectives()
