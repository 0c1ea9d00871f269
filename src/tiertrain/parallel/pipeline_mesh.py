"""A pipelined run's ranks as a 2-D mesh, dp x pp: each run of ``pp`` consecutive ranks is one pipeline
(its stages' sends and receives on the fast links of one node), and the ranks that hold the same stage in
each pipeline are that stage's data-parallel group (its gradients' reductions, across the nodes). With
tensor parallel, dp x pp x tp: each stage's blocks are cut over ``tp`` consecutive ranks, and a pipeline is
the ranks of one place in each stage's group.

Built on ``torch.distributed.device_mesh``, as ``parallel.mesh`` builds data parallel's groups: every rank
makes every group in one order. Where the backend is not gloo (NCCL), a twin mesh of gloo groups takes
the host tensors (the step's loss, the gradient norm, the data-parallel group's host side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.distributed import ProcessGroupCollectives
from tiertrain.parallel.local import LocalCollectives
from tiertrain.parallel.mesh import MeshDim
from tiertrain.parallel.tied_stages import pair_groups

NAMES = ("dp", "pp")


@dataclass
class PipelineMesh:
    pp: int
    dp: int
    pp_rank: int                    # this rank's place in its pipeline (its stages: pp_rank, pp_rank + pp, ...)
    pp_group: dist.ProcessGroup     # the pipeline's ranks: the stages' sends and receives (the backend's)
    pp_host: Collectives            # the same ranks over gloo: the step's loss and gradient norm
    stage_dp: Collectives           # this rank's stages' data-parallel group (one process: the identity)
    world: ProcessGroupCollectives  # every rank: its heartbeat names a lost rank wherever a collective fails
    groups: tuple[dist.ProcessGroup, ...] = ()  # every group the mesh made (its twins' too), destroyed at close
    tied: Collectives | None = None  # this pipeline's first- and last-stage ranks (gloo), where a weight is tied
    #                                  across them (``parallel.tied_stages``) and this rank holds one end
    tp_group: Collectives | None = None  # the ranks each of this rank's stages' blocks are cut over (tensor parallel)

    def close(self) -> None:
        """The heartbeat stopped and the mesh's groups destroyed (a run makes a pipeline once, a test many)."""
        self.world.close()
        groups, self.groups = self.groups, ()  # closing twice does nothing more
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                continue


def pipeline_mesh(pp: int, tied: bool = False, tp: int = 1) -> PipelineMesh:
    """The run's ranks (the default process group's) as dp x pp, or dp x pp x tp (each stage's blocks cut
    over ``tp`` consecutive ranks: the fastest links); ``pp`` (and ``tp``) must divide them (checked before);
    ``tied``: with each pipeline's (first, last) stage pair as a group too (pp > 1, tp = 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = ProcessGroupCollectives()
    dp = world.world_size // (pp * tp)
    names = NAMES if tp == 1 else (*NAMES, "tp")
    shape = (dp, pp) if tp == 1 else (dp, pp, tp)
    gloo = dist.get_backend() == "gloo"
    mesh = init_device_mesh("cpu" if gloo else "cuda", shape, mesh_dim_names=names)
    twins = mesh if gloo else init_device_mesh("cpu", shape, mesh_dim_names=names,
                                               backend_override={n: "gloo" for n in names})

    def group(name: str) -> Collectives:
        return ProcessGroupCollectives(mesh.get_group(name), heartbeat=world.heartbeat,
                                       host_group=None if gloo else twins.get_group(name))

    stage_dp = LocalCollectives() if dp == 1 else group("dp")
    if dp > 1:  # hybrid sharding and expert parallel split it again (``parallel.mesh``)
        stage_dp.place = MeshDim(shape, names, 0)
    pp_group = mesh.get_group("pp")
    world_group = dist.distributed_c10d._get_default_group()  # a dimension of every rank may be it: not the mesh's
    made = {id(g): g for m in (mesh, twins) for g in (m.get_group(n) for n in names) if g is not world_group}
    pp_host = ProcessGroupCollectives(twins.get_group("pp"), heartbeat=world.heartbeat)
    out = PipelineMesh(pp, dp, dist.get_rank(pp_group), pp_group, pp_host, stage_dp, world, tuple(made.values()),
                       tp_group=group("tp") if tp > 1 else None)
    if tied:
        try:
            out.tied, pairs = pair_groups(pp, dp, world.heartbeat)
        except BaseException:
            out.close()
            raise
        out.groups += tuple(pairs)
    return out
