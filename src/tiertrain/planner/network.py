"""The ranks a plan is made for and the network between them: what data parallelism costs.

Each rank plans under its own budgets (device, host, disk per rank). With ``shard`` a block's
fp32 master, moments and gradients are split over the ``dp`` ranks (each holds 1/dp: ZeRO-2 where
the block stays on the device, ZeRO-3 where it streams, Elixir's S_FLAG), and its compute params
are all-gathered before use and its gradients reduce-scattered after backward; without it every
rank holds them whole and all-reduces the gradients (DDP). The rates are what one rank sends per
second in each ring collective at the runtime's chunk sizes (``engine.measure.collectives``
measures them on this machine; a described machine's network link stands for all four), so a
collective over B bytes takes ``(dp-1)/dp x B`` (twice that for an all-reduce) over its rate,
the same formulas ``parallel.collectives`` counts the bytes sent by.

Over several nodes (``node_ranks`` ranks each, joined by links of ``across_bps`` a rank) a group that
spans nodes runs at the slower of its collective's rate and that link: flat sharding gathers and
reduces every block over it; hybrid sharding (``shard_ranks`` = a node's ranks) gathers and
reduce-scatters inside a node and sends only each shard's all-reduce across (``parallel.hybrid``):
2 (R-1)/R x B/S over the slow link for R nodes of S ranks, against every byte of every collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tiertrain.typed import at_least

_RATE = at_least(0)


@dataclass(frozen=True)
class Network:
    dp: int = field(default=1, metadata=at_least(1))        # data-parallel ranks (1: one process, no network)
    shard: bool = True                                      # states and gradients split over the ranks, or whole
    all_gather_bps: float = field(default=0.0, metadata=_RATE)      # bytes a rank sends per second, per collective
    reduce_scatter_bps: float = field(default=0.0, metadata=_RATE)
    all_reduce_bps: float = field(default=0.0, metadata=_RATE)
    all_to_all_bps: float = field(default=0.0, metadata=_RATE)
    source: str = ""                                        # measured here, or the described machine's link
    node_ranks: int = field(default=0, metadata=at_least(0))   # ranks per node (0: every rank on one node)
    across_bps: float = field(default=0.0, metadata=_RATE)     # a rank's rate between nodes (0: the rates above)
    shard_ranks: int = field(default=0, metadata=at_least(0))  # ranks a sharded block is split over (0: all dp)
    ep: int = field(default=1, metadata=at_least(1))           # ranks a block's experts are divided over
    staged: bool = False  # a pipeline stage's replicas: no hybrid sharding inside a stage yet (``api.pipeline``)

    @classmethod
    def from_link(cls, dp: int, bps: float, source: str) -> "Network":
        """Every collective at one link's bandwidth (a described machine: ring collectives saturate it)."""
        return cls(dp, True, bps, bps, bps, bps, source)

    @property
    def parallel(self) -> bool:
        return self.dp > 1

    @property
    def split(self) -> int:
        """Ranks a sharded block's states are split over."""
        return self.shard_ranks or self.dp

    @property
    def hybrid(self) -> bool:
        return self.shard and 1 < self.split < self.dp

    def layouts(self) -> list[Network]:
        """The layouts a plan over these ranks may take: every block sharded over all of them, every
        block replicated, and where the ranks span nodes, sharded inside each node and replicated across."""
        out = [dataclasses.replace(self, shard=True, shard_ranks=0), dataclasses.replace(self, shard=False, shard_ranks=0)]
        if 1 < self.node_ranks < self.dp and self.dp % self.node_ranks == 0 and self.ep == 1 and not self.staged:
            out.append(dataclasses.replace(self, shard=True, shard_ranks=self.node_ranks))
        return out

    def per_rank(self, numel: int) -> int:
        """Elements of a block's states (or gradients) one rank holds."""
        return -(-numel // self.split) if self.shard else numel

    def gather_s(self, nbytes: float) -> float:
        """A sharded block's compute params (``nbytes`` whole) all-gathered into its slot."""
        return self._ring(nbytes, self.split, self.all_gather_bps)

    def reduce_s(self, nbytes: float, shard: bool) -> float:
        """A block's gradients (``nbytes`` whole) reduced over the ranks: reduce-scattered when
        sharded, all-reduced (twice the bytes) when replicated; hybrid: reduce-scattered inside the
        group, then each shard all-reduced across the groups."""
        if not shard:
            return 2 * self._ring(nbytes, self.dp, self.all_reduce_bps)
        inside = self._ring(nbytes, self.split, self.reduce_scatter_bps)
        if not self.hybrid:
            return inside
        return inside + 2 * self._ring(nbytes / self.split, self.dp // self.split, self.all_reduce_bps, across=True)

    def experts_reduce_s(self, nbytes: float) -> float:
        """A rank's held experts' gradients (``nbytes``) all-reduced over the ranks holding the same
        experts, one per expert group (``dp / ep`` of them, spread over the nodes)."""
        return 2 * self._ring(nbytes, self.dp // self.ep, self.all_reduce_bps, across=0 < self.node_ranks < self.dp)

    def sent_bytes(self, nbytes: float, ranks: int = 0) -> float:
        """What a rank sends in a ring collective over ``nbytes`` among ``ranks`` (0: all; an all-reduce
        sends this twice)."""
        ranks = ranks or self.dp
        return nbytes * (ranks - 1) / ranks

    def _ring(self, nbytes: float, ranks: int, bps: float, across: bool = False) -> float:
        """Seconds on the wire for a group of ``ranks`` (consecutive ones, or with ``across`` one per
        group): at the link between nodes where the group spans nodes; nothing where there is one rank,
        or no rate (a plan laid out over ranks without a network description leaves communication out)."""
        if across or 0 < self.node_ranks < ranks:
            bps = min(bps, self.across_bps) if self.across_bps else bps
        return self.sent_bytes(nbytes, ranks) / bps if ranks > 1 and bps > 0 else 0.0
