"""The run's ranks as a 2-D mesh, outer x inner: groups of ``inner`` consecutive ranks (one node's GPUs,
on its fast links) and, across them, the ranks that hold the same place in each group. Hybrid sharding
(``parallel.hybrid``: shard inside a group, replicate across) and expert parallel (experts divided inside
a group, their replicas across) both lay the ranks out so.

A tensor-parallel or pipelined run's data-parallel group is itself one dimension of a larger mesh
(dp x tp, dp x pp, dp x pp x tp): its ranks are not consecutive, and a mesh of its ranks alone cannot be
made (a group is made by every rank of the run, in one order). So such a group carries its ``MeshDim``,
and splitting it makes the run's whole mesh again with that dimension split in two (dp x tp becomes
outer x inner x tp): every rank of the run splits its own data-parallel group at the same point of its
setup, in one order, and each takes the two groups it lies in.

Built on ``torch.distributed.device_mesh`` (the mesh torch's FSDP2 and tensor parallel take), which
makes every dimension's process groups on every rank in one order, as ``new_group`` requires. Where the
run's backend is not gloo (NCCL), a second mesh of gloo groups over the same ranks takes the host
tensors (``Collectives.host``): NCCL refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.placement import PlacementChecked, checked_like


@dataclass(frozen=True)
class MeshDim:
    """Dimension ``dim`` of the run's mesh of ``shape`` (dimensions named ``names``): where a group lies."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    dim: int

    def split(self, outer: int, inner: int, names: tuple[str, str]) -> MeshDim:
        """The mesh with this dimension split into ``outer`` x ``inner`` (named ``names``), at its place."""
        d = self.dim
        return MeshDim((*self.shape[:d], outer, inner, *self.shape[d + 1:]),
                       (*self.names[:d], *names, *self.names[d + 1:]), d)


def mesh_collectives(world: Collectives, outer: int, inner: int,
                     names: tuple[str, str]) -> tuple[Collectives, Collectives]:
    """This rank's (inner group, outer group) of an ``outer`` x ``inner`` mesh of ``world``'s ranks (the
    run's, or a data-parallel group that carries its ``MeshDim``), whose dimensions are named ``names``
    (outer, inner): collectives that report a lost peer with the run's heartbeat, checked as ``world``'s
    are."""
    if outer * inner != world.world_size or outer < 2 or inner < 2:
        raise ValueError(f"internal: a {outer} x {inner} mesh of {world.world_size} ranks")
    place = mesh_dim_of(world)
    if place is None:
        place = MeshDim((world.world_size,), ("world",), 0)
    made = dim_groups(place.split(outer, inner, names), names[::-1], getattr(world, "heartbeat", None))
    return checked_like(world, made[0]), checked_like(world, made[1])


def dim_groups(mesh: MeshDim, names: tuple[str, ...], heartbeat=None) -> list[Collectives]:
    """The run's ranks laid out as ``mesh`` (every rank calls this, in one order): this rank's group in each
    dimension named in ``names``, each carrying its place in the mesh (so it can be split again)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tiertrain.parallel.distributed import ProcessGroupCollectives

    gloo = dist.get_backend() == "gloo"
    made = init_device_mesh("cpu" if gloo else "cuda", mesh.shape, mesh_dim_names=mesh.names)
    twins = None if gloo else init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.names,
                                              backend_override={n: "gloo" for n in mesh.names})
    out = []
    for name in names:
        group = ProcessGroupCollectives(made.get_group(name), heartbeat=heartbeat,
                                        host_group=None if twins is None else twins.get_group(name))
        group.place = MeshDim(mesh.shape, mesh.names, mesh.names.index(name))
        out.append(group)
    world = dist.distributed_c10d._get_default_group()  # a dimension of every rank may be it: not the mesh's
    every = {id(g): g for m in (made, twins) if m is not None for g in map(m.get_group, mesh.names) if g is not world}
    out[0].made = list(every.values())  # (the first group named closes them all, the others' too)
    return out


def mesh_dim_of(group: Collectives) -> MeshDim | None:
    """Where ``group`` (or the group a placement check wraps) lies in the run's mesh; None for the run's
    ranks in one dimension, or a group made otherwise."""
    while isinstance(group, PlacementChecked):
        group = group.inner
    return getattr(group, "place", None)
