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
from tiertrain.parallel.mesh import MeshDim, dim_groups
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
    world = ProcessGroupCollectives()
    dp = world.world_size // (pp * tp)
    names = NAMES if tp == 1 else (*NAMES, "tp")
    shape = (dp, pp) if tp == 1 else (dp, pp, tp)
    by = dict(zip(names, dim_groups(MeshDim(shape, names, 0), names, world.heartbeat)))
    made, by["dp"].made = by["dp"].made, []  # the mesh's groups: this mesh destroys them as it closes
    pp_group = by["pp"].group
    out = PipelineMesh(pp, dp, dist.get_rank(pp_group), pp_group, by["pp"].host,
                       LocalCollectives() if dp == 1 else by["dp"], world, tuple(made), tp_group=by.get("tp"))
    if tied:
        try:
            out.tied, pairs = pair_groups(pp, dp, world.heartbeat)
        except BaseException:
            out.close()
            raise
        out.groups += tuple(pairs)
    return out
