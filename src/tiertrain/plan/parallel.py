"""How a run is laid out over processes: part of the plan, as data.

``dp`` ranks each train on their own batches; every block's chunks are split over them (``shard``)
or replicated. ``ep`` (expert parallel, ANGEL-PTM §6.4, Elixir's MoE case): a mixture-of-experts
model's experts are divided over groups of ``ep`` consecutive ranks, each rank holding
``n_experts / ep`` of them whole, and tokens travel to the rank of their expert by all-to-all.
The other parameters stay laid out over all ``dp`` ranks. With ``ep < dp`` each expert is held by
``dp / ep`` ranks (one per expert group), whose gradients of it are summed.

``shard_group`` (hybrid sharding, FSDP2's HSDP, ZeRO++'s hpZ): a sharded block is split over groups of
that many consecutive ranks (the GPUs of one node, on its fast links) and replicated across the groups
(the slow links between nodes carry only each shard's all-reduce, never a gather). The ranks form a
2-D mesh, replicate x shard (``parallel.mesh``); 0 means one group of every rank (flat sharding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiertrain.errors import ConfigError
from tiertrain.typed import at_least


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = field(default=1, metadata=at_least(1))  # data-parallel ranks each block's chunks are split over
    ep: int = field(default=1, metadata=at_least(1))  # ranks a mixture-of-experts layer's experts are divided over
    shard_group: int = field(default=0, metadata=at_least(0))  # ranks a sharded block is split over (0: all dp)
    tp: int = field(default=1, metadata=at_least(1))  # tensor parallel: each rank holds 1/tp of a block's cut part
    sequence_parallel: bool = False  # with tp: each rank holds its slice of the sequence between the cut regions

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) for v in (self.dp, self.ep, self.shard_group, self.tp)):
            return  # typed.load names the field of another type
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel slices the sequence over a tensor-parallel group: give tp above 1, "
                              "or leave sequence_parallel out")
        if self.ep >= 1 and self.dp % self.ep:
            raise ConfigError(f"expert parallel ep={self.ep} does not divide the {self.dp} data-parallel ranks; "
                              f"choose ep among {_divisors(self.dp)}")
        if self.shard_group and (self.shard_group < 2 or self.dp % self.shard_group):
            groups = [k for k in range(2, self.dp) if self.dp % k == 0]
            fix = (f"choose --shard-group among {', '.join(map(str, groups))} (the GPUs of one node)" if groups else
                   f"{self.dp} ranks make no groups of two or more that are not all of them")
            raise ConfigError(f"hybrid sharding over groups of {self.shard_group} ranks does not divide the {self.dp} "
                              f"data-parallel ranks into groups of two or more; {fix}, or leave it out "
                              "(--shard-group 0) to shard over every rank")
        if self.shard_group == self.dp:
            object.__setattr__(self, "shard_group", 0)  # one group of every rank: flat sharding, one way to say it
        if self.hybrid and self.ep > 1:
            raise ConfigError(f"hybrid sharding (shard_group={self.shard_group}) with expert parallel (ep={self.ep}) is "
                              "not supported yet: leave out one of --shard-group and --ep")

    @property
    def shard_ranks(self) -> int:
        """Ranks a sharded block's states and gradients are split over."""
        return self.shard_group or self.dp

    @property
    def hybrid(self) -> bool:
        """Sharded inside groups, replicated across them (more than one group)."""
        return 0 < self.shard_group < self.dp

    @property
    def world_size(self) -> int:
        return self.dp

    def to_dict(self) -> dict:
        return {"dp": self.dp} | ({"ep": self.ep} if self.ep > 1 else {}) | (
            {"shard_group": self.shard_group} if self.hybrid else {}) | ({"tp": self.tp} if self.tp > 1 else {}) | (
            {"sequence_parallel": True} if self.sequence_parallel else {})

    def check_run(self, tp: int, sequence_parallel: bool, where: str) -> None:
        """Refuse a run cut otherwise than the plan was made for: its bytes a rank holds are 1/tp of each
        block's cut part, and without sequence parallel each rank would hold the whole sequence's norms and
        residuals its planned activations leave out. (A plan made without sequence parallel fits a run with
        it: that holds less.)"""
        if self.tp > 1 and tp != self.tp:
            raise ConfigError(f"{where} was made for --tp {self.tp} (each rank 1/{self.tp} of a block) but this run "
                              f"has --tp {tp}: give --tp {self.tp}, or make the plan for it (tiertrain plan --tp {tp} ...)")
        if self.sequence_parallel and not sequence_parallel:
            raise ConfigError(f"{where} was made with --sequence-parallel (each rank its slice of the sequence between "
                              "the cut regions): add --sequence-parallel, or make the plan without it")


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
