"""How a run is laid out over processes: part of the plan, as data.

``dp`` ranks each train on their own batches; every block's chunks are split over them (``shard``)
or replicated. ``ep`` (expert parallel, ANGEL-PTM §6.4, Elixir's MoE case): a mixture-of-experts
model's experts are divided over groups of ``ep`` consecutive ranks, each rank holding
``n_experts / ep`` of them whole, and tokens travel to the rank of their expert by all-to-all.
The other parameters stay laid out over all ``dp`` ranks. With ``ep < dp`` each expert is held by
``dp / ep`` ranks (one per expert group), whose gradients of it are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiertrain.errors import ConfigError
from tiertrain.typed import at_least


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = field(default=1, metadata=at_least(1))  # data-parallel ranks each block's chunks are split over
    ep: int = field(default=1, metadata=at_least(1))  # ranks a mixture-of-experts layer's experts are divided over

    def __post_init__(self) -> None:
        if isinstance(self.dp, int) and isinstance(self.ep, int) and self.ep >= 1 and self.dp % self.ep:
            raise ConfigError(f"expert parallel ep={self.ep} does not divide the {self.dp} data-parallel ranks; "
                              f"choose ep among {', '.join(str(k) for k in range(1, self.dp + 1) if self.dp % k == 0)}")

    @property
    def world_size(self) -> int:
        return self.dp

    def to_dict(self) -> dict:
        return {"dp": self.dp} if self.ep == 1 else {"dp": self.dp, "ep": self.ep}
