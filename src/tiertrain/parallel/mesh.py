"""The run's ranks as a 2-D mesh, outer x inner: groups of ``inner`` consecutive ranks (one node's GPUs,
on its fast links) and, across them, the ranks that hold the same place in each group. Hybrid sharding
(``parallel.hybrid``: shard inside a group, replicate across) and expert parallel (experts divided inside
a group, their replicas across) both lay the ranks out so.

Built on ``torch.distributed.device_mesh`` (the mesh torch's FSDP2 and tensor parallel take), which
makes every dimension's process groups on every rank in one order, as ``new_group`` requires. Where the
run's backend is not gloo (NCCL), a second mesh of gloo groups over the same ranks takes the host
tensors (``Collectives.host``): NCCL refuses them.
"""

from __future__ import annotations

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.placement import checked_like


def mesh_collectives(world: Collectives, outer: int, inner: int,
                     names: tuple[str, str]) -> tuple[Collectives, Collectives]:
    """This rank's (inner group, outer group) of an ``outer`` x ``inner`` mesh of the run's ranks, whose
    dimensions are named ``names`` (outer, inner): collectives that report a lost peer with the run's
    heartbeat, checked as ``world``'s are."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tiertrain.parallel.distributed import ProcessGroupCollectives

    if outer * inner != world.world_size or outer < 2 or inner < 2:
        raise ValueError(f"internal: a {outer} x {inner} mesh of {world.world_size} ranks")
    gloo = dist.get_backend() == "gloo"
    mesh = init_device_mesh("cpu" if gloo else "cuda", (outer, inner), mesh_dim_names=names)
    twins = None if gloo else init_device_mesh("cpu", (outer, inner), mesh_dim_names=names,
                                              backend_override={n: "gloo" for n in names})
    beat = getattr(world, "heartbeat", None)
    made = [ProcessGroupCollectives(mesh.get_group(n), heartbeat=beat,
                                    host_group=None if twins is None else twins.get_group(n))
            for n in (names[1], names[0])]
    return checked_like(world, made[0]), checked_like(world, made[1])
