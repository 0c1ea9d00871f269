"""Live and peak bytes per tier and per state kind; thread-safe, cheap enough to call per move."""

from __future__ import annotations

import threading
from collections import defaultdict

from tiertrain.plan.tiers import Kind, Tier


class Accounting:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[Tier, dict[Kind, int]] = defaultdict(lambda: defaultdict(int))
        self._peak_kind: dict[Tier, dict[Kind, int]] = defaultdict(lambda: defaultdict(int))
        self._live_total: dict[Tier, int] = defaultdict(int)
        self._peak_total: dict[Tier, int] = defaultdict(int)
        self._chunks: dict[Tier, dict[Kind, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        with self._lock:
            live = self._live[tier][kind] = self._live[tier][kind] + nbytes
            self._peak_kind[tier][kind] = max(self._peak_kind[tier][kind], live)
            total = self._live_total[tier] = self._live_total[tier] + nbytes
            self._peak_total[tier] = max(self._peak_total[tier], total)
            self._chunks[tier][kind] += 1

    def sub(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        with self._lock:
            self._live[tier][kind] -= nbytes
            self._live_total[tier] -= nbytes
            self._chunks[tier][kind] -= 1
            assert self._live[tier][kind] >= 0, f"accounting went negative for {tier.value}/{kind.value}"

    def live(self, tier: Tier, kind: Kind | None = None) -> int:
        with self._lock:
            return self._live_total[tier] if kind is None else self._live[tier][kind]

    def chunks(self, tier: Tier, kind: Kind) -> int:
        """How many chunks of ``kind`` live in ``tier`` now."""
        with self._lock:
            return self._chunks[tier][kind]

    def peak(self, tier: Tier, kind: Kind | None = None) -> int:
        with self._lock:
            return self._peak_total[tier] if kind is None else self._peak_kind[tier][kind]

    def report(self) -> dict[str, dict[str, object]]:
        """``{tier: {"live": n, "peak": n, "live_by_kind": {...}, "peak_by_kind": {...}}}``."""
        with self._lock:
            return {t.value: {"live": self._live_total[t], "peak": self._peak_total[t],
                              "live_by_kind": {k.value: v for k, v in self._live[t].items() if v},
                              "peak_by_kind": {k.value: v for k, v in self._peak_kind[t].items() if v}}
                    for t in Tier}
