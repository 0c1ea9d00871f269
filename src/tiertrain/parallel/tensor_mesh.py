"""A tensor-parallel run's ranks as dp x tp: each run of ``tp`` consecutive ranks (one node's GPUs, on its
fast links: tensor parallel sums activations twice per block forward and twice backward) cuts every
block over itself, and the ranks holding the same shard in each group are that shard's data-parallel
group (its gradients' reductions, across the nodes), made as data parallel's hybrid groups are
(``parallel.mesh``, on ``torch.distributed.device_mesh``); that group splits again for hybrid sharding or
expert parallel inside it (dp x tp as outer x inner x tp).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.distributed import ProcessGroupCollectives
from tiertrain.parallel.local import LocalCollectives
from tiertrain.parallel.mesh import MeshDim, dim_groups


@dataclass
class TensorMesh:
    tp: int
    dp: int
    tp_group: Collectives   # this rank's tensor-parallel group: the blocks' sums; its ``host``: the step's norm
    dp_group: Collectives   # the ranks holding this rank's shard (one process: the identity)
    world: ProcessGroupCollectives  # every rank: its heartbeat names a lost rank wherever a collective fails

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank is in: every rank of a tensor-parallel group reads its batch."""
        return self.dp_group.rank

    def close(self) -> None:
        """The heartbeat stopped and the groups the mesh made destroyed."""
        self.world.close()
        for group in (self.tp_group, self.dp_group):
            if group is not self.world:
                group.close()


def tensor_mesh(tp: int) -> TensorMesh:
    """The run's ranks (the default process group's) as dp x tp; ``tp`` divides them (checked before)."""
    world = ProcessGroupCollectives()
    dp = world.world_size // tp
    if dp == 1:
        return TensorMesh(tp, dp, world, LocalCollectives(), world)
    if tp == 1:
        return TensorMesh(tp, dp, LocalCollectives(), world, world)
    tp_group, dp_group = dim_groups(MeshDim((dp, tp), ("dp", "tp"), 0), ("tp", "dp"), world.heartbeat)
    return TensorMesh(tp, dp, tp_group, dp_group, world)
