"""A pipelined layout, as data: how many stages, which schedule, how many micro-batches, and how the
model's blocks are folded onto the stages.

FOLD3D (``../shared/papers/002_*``, §3.2 step 1) folds the model into ``segments`` (its ns), each split
over the ``pp`` stages: with 12 blocks A..L, ns = 2 and p = 3, rank 0 holds (A, B) and (G, H), rank 1
(C, D) and (I, J), rank 2 (E, F) and (K, L). Each (segment, stage) is a virtual stage ``v = segment x pp +
rank``, the numbering torch's multi-stage schedules use (``torch.distributed.pipelining``: rank ``r``
holds stages ``r, r + pp, ...``), so the interleaved schedules fold the same way with ``segments`` as
their stages per rank; 1F1B and GPipe hold one (``segments`` = 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tiertrain.errors import ConfigError
from tiertrain.plan.plan import Plan
from tiertrain.typed import at_least, one_of

SCHEDULES = ("aiao", "1f1b", "interleaved", "gpipe")
MULTI_STAGE = ("aiao", "interleaved")  # the schedules that hold several segments (virtual stages) per rank


@dataclass(frozen=True)
class PipelineLayout:
    pp: int = field(default=1, metadata=at_least(1))             # pipeline stages, one rank each
    schedule: str = field(default="aiao", metadata=one_of(*SCHEDULES))
    micro_batches: int = field(default=1, metadata=at_least(1))  # M: each step's batch split into these
    segments: int = field(default=1, metadata=at_least(1))       # FOLD3D's ns: virtual stages per rank

    @property
    def stages(self) -> int:
        """Virtual stages over all ranks: each segment split over the ``pp`` ranks."""
        return self.pp * self.segments

    def check(self, world: int, n_blocks: int, batch: int) -> None:
        """Refuse what no rank could run, in one line naming the fix (every rank calls it alike, before
        anything starts)."""
        if world % self.pp:
            raise ConfigError(f"--pp {self.pp} does not divide the {world} ranks; choose --pp among "
                              f"{', '.join(str(k) for k in range(1, world + 1) if world % k == 0)}")
        if self.segments > 1 and self.schedule not in MULTI_STAGE:
            raise ConfigError(f"the {self.schedule} schedule holds one stage per rank; give --segments 1, or "
                              f"choose --schedule {' or '.join(MULTI_STAGE)}")
        if self.stages > n_blocks:
            raise ConfigError(f"{self.stages} pipeline stages ({self.pp} ranks x {self.segments} segments) for a "
                              f"model of {n_blocks} blocks: each stage needs a block; lower --pp or --segments")
        if self.schedule == "1f1b" and self.micro_batches < self.pp:
            raise ConfigError(f"1F1B keeps each of the {self.pp} stages busy with a micro-batch of its own: give "
                              f"--micro-batches {self.pp} or more (not {self.micro_batches})")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise ConfigError(f"the interleaved schedule takes micro-batches in rounds of the {self.pp} stages: "
                              f"--micro-batches {self.micro_batches} is not a multiple of {self.pp}")
        if batch % self.micro_batches:
            raise ConfigError(f"a batch of {batch} sequences does not split into {self.micro_batches} micro-batches; "
                              "choose --micro-batches dividing --batch-size")


def fold(n_blocks: int, pp: int, segments: int) -> tuple[range, ...]:
    """The blocks of each virtual stage ``v = segment x pp + rank`` (FOLD3D §3.2 step 1): the model cut
    into ``pp x segments`` runs of consecutive blocks, as even as the count allows (the earlier runs one
    block longer)."""
    stages = pp * segments
    if not 1 <= stages <= n_blocks:
        raise ValueError(f"internal: {stages} stages for {n_blocks} blocks")
    per, extra = divmod(n_blocks, stages)
    out, start = [], 0
    for v in range(stages):
        end = start + per + (1 if v < extra else 0)
        out.append(range(start, end))
        start = end
    return tuple(out)


def rank_of(stage: int, pp: int) -> int:
    """The rank that holds virtual stage ``stage``."""
    return stage % pp


def stage_plan(plan: Plan, blocks: range, n_blocks: int, largest: int) -> Plan:
    """One stage's plan for its ``blocks`` of the model's ``n_blocks``: a whole model's plan cut to them (each
    keeps its own block's plan), or a stage's plan (``tiertrain plan --pp``: as many blocks as the ``largest``
    stage holds) taken from its first block on. The stage's rest, its embeddings or head where it holds
    them, keeps the plan's rest's."""
    if len(plan.blocks) == n_blocks:
        cut = plan.blocks[blocks.start:blocks.stop]
    elif len(plan.blocks) == largest:
        cut = plan.blocks[:len(blocks)]
    else:
        raise ConfigError(f"the plan has {len(plan.blocks)} blocks: make it for the model's {n_blocks}, or for a "
                          f"stage's {largest} (tiertrain plan --nproc N --pp P)")
    return dataclasses.replace(plan, blocks=cut, name=f"{plan.name}[{blocks.start}:{blocks.stop}]").validate(len(blocks))
