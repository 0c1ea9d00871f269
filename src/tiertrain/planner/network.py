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
"""

from __future__ import annotations

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

    @classmethod
    def from_link(cls, dp: int, bps: float, source: str) -> "Network":
        """Every collective at one link's bandwidth (a described machine: ring collectives saturate it)."""
        return cls(dp, True, bps, bps, bps, bps, source)

    @property
    def parallel(self) -> bool:
        return self.dp > 1

    def per_rank(self, numel: int) -> int:
        """Elements of a block's states (or gradients) one rank holds."""
        return -(-numel // self.dp) if self.shard else numel

    def gather_s(self, nbytes: float) -> float:
        """A sharded block's compute params (``nbytes`` whole) all-gathered into its slot."""
        return self._ring(nbytes, self.all_gather_bps)

    def reduce_s(self, nbytes: float, shard: bool) -> float:
        """A block's gradients (``nbytes`` whole) reduced over the ranks: reduce-scattered when
        sharded, all-reduced (twice the bytes) when replicated."""
        if shard:
            return self._ring(nbytes, self.reduce_scatter_bps)
        return 2 * self._ring(nbytes, self.all_reduce_bps)

    def sent_bytes(self, nbytes: float) -> float:
        """What a rank sends in a ring collective over ``nbytes`` (an all-reduce sends this twice)."""
        return nbytes * (self.dp - 1) / self.dp

    def _ring(self, nbytes: float, bps: float) -> float:
        """Seconds on the wire; nothing where there is one rank, or no rate (a plan laid out over
        ranks without a network description: its prediction leaves communication out)."""
        return self.sent_bytes(nbytes) / bps if self.parallel and bps > 0 else 0.0
