"""How a run is laid out over processes: part of the plan, as data.

Today every run is one process (``dp = 1``): the block groups call their collectives through
``tiertrain.parallel``'s single-process implementation, which does nothing. The field exists so
that data parallelism (sharded chunks over ``dp`` ranks) is a change of this value and of the
collectives behind it, not of the runtime's structure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiertrain.typed import at_least


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = field(default=1, metadata=at_least(1))  # data-parallel ranks each block's chunks are split over

    @property
    def world_size(self) -> int:
        return self.dp

    def to_dict(self) -> dict:
        return {"dp": self.dp}
