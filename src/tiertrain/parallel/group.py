"""The process group a run belongs to: the one the user's script initialised, or one started from
``torchrun``'s environment (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...): gloo on CPU, NCCL on GPUs,
each rank on its own GPU (``LOCAL_RANK``)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from tiertrain.errors import ConfigError
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.local import LocalCollectives

TIMEOUT = timedelta(seconds=int(os.environ.get("TIERTRAIN_COLLECTIVE_TIMEOUT", "60")))


def world_from_env() -> int:
    """Ranks this process runs among: the initialised group's, else torchrun's ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    """This process's rank: the initialised group's, else torchrun's ``RANK``, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def ensure_process_group() -> None:
    """Initialise the default process group from torchrun's environment if the script has not."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        raise ConfigError("WORLD_SIZE > 1 but no torchrun environment (RANK, MASTER_ADDR): launch with "
                          "`torchrun --nproc-per-node N ...`, or initialise torch.distributed before tiertrain.setup")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)


def end_process_group() -> None:
    """Destroy the default process group, where one is up, before the interpreter exits. Left to the
    interpreter's teardown, gloo's threads now and then aborted a rank after its run had finished
    ("terminate called without an active exception": 1 in 12 to 20 expert-parallel resumes here)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def collectives_for(world_size: int) -> Collectives:
    """The collectives of a plan's layout: the identity for one process; over the default
    ``torch.distributed`` group otherwise (initialised here from torchrun's environment if needed)."""
    if world_size == 1:
        return LocalCollectives()
    import torch.distributed as dist

    from tiertrain.parallel.distributed import ProcessGroupCollectives

    ensure_process_group()
    if dist.get_world_size() != world_size:
        raise ConfigError(f"the plan is laid out for {world_size} ranks but this run has {dist.get_world_size()}; "
                          "make the plan for this many ranks (or let tiertrain lay it out: leave its parallel field)")
    return ProcessGroupCollectives()
