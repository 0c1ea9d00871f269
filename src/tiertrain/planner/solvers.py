"""Solvers: from a profile and budgets to per-block choices (H3T §3.3, App. B; STRONGHOLD §III-D).

All of them search the same space under the same cost model (``costs``) and the same
device-memory discretisation, so their answers compare: dynamic programming is optimal
within the discretisation, and the tests hold it to exhaustive search. Device memory is
split into ``levels`` equal units; a block's bytes round *up* to whole units, so whatever a
solver accepts fits. Host and disk are checked after the device search (``costs.homes``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from dataclasses import dataclass

import numpy as np

from tiertrain.plan.budgets import Budgets
from tiertrain.planner import costs
from tiertrain.planner.costs import Choice, choices_for
from tiertrain.planner.profile import Profile


DEVICE_LEVELS_PER_BLOCK = 4
HOST_LEVELS_PER_BLOCK = 2


def levels_for(n_blocks: int, levels: int | None = None) -> tuple[int, int]:
    """(device, host) levels for ``n_blocks``: each block's bytes round up to a whole unit, so with
    fewer units than a few per block the rounding alone eats the budget (70 blocks at m=128 and 16
    host levels found no plan for GPT3-175B where 280 x 140 finds one, as fast as 560 x 280 finds)."""
    return max(levels or 128, DEVICE_LEVELS_PER_BLOCK * n_blocks), max(16, HOST_LEVELS_PER_BLOCK * n_blocks)


@dataclass(frozen=True)
class Problem:
    profile: Profile
    budgets: Budgets                     # what each tier may hold (one rank's, over several)
    levels: int = 128                    # device memory discretisation (H3T's m)
    windows: tuple[int, ...] = (1, 2, 3)
    host_levels: int = 16                # host bytes the switches add (stashes), discretised the same way

    @classmethod
    def sized(cls, profile: Profile, budgets: Budgets, levels: int | None = None) -> "Problem":
        """A problem discretised for its number of blocks (``levels_for``); ``levels`` a floor for the device's."""
        m, hm = levels_for(len(profile.blocks), levels)
        return cls(profile, budgets, levels=m, host_levels=hm)

    def with_budgets(self, **sizes: int) -> "Problem":
        """The problem under other budgets for some tiers (``device=``, ``host=``, ``disk=``)."""
        return dataclasses.replace(self, budgets=dataclasses.replace(self.budgets, **sizes))

    @property
    def device(self) -> int:
        return self.budgets.device

    @property
    def host(self) -> int:
        return self.budgets.host

    @property
    def disk(self) -> int:
        return self.budgets.disk

    @functools.cached_property
    def unit(self) -> float:
        """The device bytes of one level: the room the blocks compete for (the budget less the bytes no
        switch removes, at their fewest) over ``levels``, not the whole budget: a 2 GiB budget that a
        1.7B's fixed bytes leave 246 MiB of gave its 24 recomputed blocks 16 MiB levels for 0.6 MB each
        (24 levels of 15), and no plan fit."""
        free = self.device - costs.fixed_device_bytes(self.profile, 1, False)  # once: every level() divides by it
        return max(free if free > 0 else self.device, 1) / self.levels

    def capacity(self, window: int, any_stream: bool) -> int:
        """Whole units left for the blocks once the fixed bytes are placed (negative: none)."""
        free = self.device - costs.fixed_device_bytes(self.profile, window, any_stream)
        return math.floor(free / self.unit) if free >= 0 else -1

    def level(self, i: int, c: Choice) -> int:
        return math.ceil(costs.device_bytes(self.profile, self.profile.blocks[i], c) / self.unit)

    @property
    def host_unit(self) -> float:
        return max(self.host, 1) / self.host_levels

    def host_capacity(self) -> int:
        free = self.host - costs.base_host_bytes(self.profile, self.disk)
        return math.floor(free / self.host_unit) if free >= 0 else -1

    def host_level(self, i: int, c: Choice) -> int:
        return math.ceil(costs.switch_host_bytes(self.profile, self.profile.blocks[i], c) / self.host_unit)

    def seconds(self, i: int, c: Choice, window: int, disk_home: bool = False) -> float:
        p = self.profile
        return costs.block_seconds(p.blocks[i], c, p.machine, p.compute_bytes, window, disk_home, p.disk_passes,
                                   p.network, p.micro_batches)


@dataclass(frozen=True)
class Solution:
    choices: tuple[Choice, ...]
    window: int
    disk_home: tuple[bool, ...]
    seconds: float                       # the cost model's step time (the simulator's is separate)
    solver: str


def evaluate(pb: Problem, choices: tuple[Choice, ...], window: int, solver: str) -> Solution | None:
    """The cost of a full assignment, or None when it does not fit the budgets."""
    any_stream = any(c.stream for c in choices)
    if any_stream and window < 1:
        return None
    used = sum(pb.level(i, c) for i, c in enumerate(choices))
    if used > pb.capacity(window if any_stream else 1, any_stream):
        return None
    if sum(pb.host_level(i, c) for i, c in enumerate(choices)) > pb.host_capacity():
        return None
    disk = costs.homes(pb.profile, choices, pb.host, pb.disk)
    if disk is None:
        return None
    t = sum(pb.seconds(i, c, window, d) for i, (c, d) in enumerate(zip(choices, disk)))
    return Solution(tuple(choices), window if any_stream else 1, disk, t, solver)


def _best(solutions) -> Solution | None:
    found = [s for s in solutions if s is not None]
    return min(found, key=lambda s: s.seconds) if found else None


def _variants(pb: Problem):
    """(window, whether blocks may stream, device units, host units) for every variant with room
    left for the blocks; without streaming the window does not matter."""
    hcap = pb.host_capacity()
    for window, stream_ok in [(1, False)] + [(w, True) for w in pb.windows]:
        cap = pb.capacity(window, stream_ok)
        if cap >= 0 and hcap >= 0:
            yield window, stream_ok, cap, hcap


def _options(pb: Problem, i: int, window: int, stream_ok: bool) -> list[tuple[int, int, float, Choice]]:
    """A block's (device levels, host levels, seconds, choice), without those another choice beats
    on all three (H3T's first pruning)."""
    opts = [(pb.level(i, c), pb.host_level(i, c), pb.seconds(i, c, window), c) for c in choices_for(pb.profile)
            if stream_ok or not c.stream]
    return [o for o in opts if not any(q[0] <= o[0] and q[1] <= o[1] and q[2] <= o[2] and q[:3] != o[:3] for q in opts)]


def dynamic_programming(pb: Problem) -> Solution | None:
    """H3T Alg. 3: best[m, h] = the fastest first-i blocks using at most m device and h host units.

    Its second pruning is the running minimum over m and h: a state using more memory and no
    less time than another is dropped (``src`` remembers which state a kept minimum came from)."""
    return _best(_dp_variant(pb, *variant) for variant in _variants(pb))


def feasible(pb: Problem) -> bool:
    """Whether the DP finds a plan, stopping at the first variant that has one (one slot first:
    the one that leaves the blocks most device memory)."""
    variants = sorted(_variants(pb), key=lambda v: (v[0] != 1 or not v[1], v[0]))
    return any(_dp_variant(pb, *variant) is not None for variant in variants)


def _dp_variant(pb: Problem, window: int, stream_ok: bool, cap: int, hcap: int) -> Solution | None:
    """The DP for one window variant (``_variants``): its best full assignment, or None."""
    best = np.full((cap + 1, hcap + 1), np.inf)
    best[0, 0] = 0.0
    trail = []
    for i in range(len(pb.profile.blocks)):
        opts = _options(pb, i, window, stream_ok)
        new, arg = np.full_like(best, np.inf), np.full(best.shape, -1, dtype=np.int8)  # <= 16 choices
        for k, (lv, hl, t, _) in enumerate(opts):
            if lv > cap or hl > hcap:
                continue
            cand = np.full_like(best, np.inf)
            cand[lv:, hl:] = best[: cap + 1 - lv, : hcap + 1 - hl] + t
            better = cand < new
            new[better], arg[better] = cand[better], k
        best, src = _dominance_prune(new)
        trail.append((opts, arg, src))
    if not np.isfinite(best[cap, hcap]):
        return None
    return evaluate(pb, _backtrack(trail, cap, hcap), window, "dp")


def _running_argmin(a: np.ndarray, axis: int) -> np.ndarray:
    idx = np.broadcast_to(np.arange(a.shape[axis]).reshape((-1, 1) if axis == 0 else (1, -1)), a.shape)
    keep = np.minimum.accumulate(a, axis=axis)
    return np.maximum.accumulate(np.where(a == keep, idx, 0), axis=axis)


def _dominance_prune(new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """best[m, h] = min over m' <= m, h' <= h; src[m, h] = the (m', h') it came from."""
    rows = _running_argmin(new, 0)
    val0 = np.take_along_axis(new, rows, 0)
    cols = _running_argmin(val0, 1)
    src_m = np.take_along_axis(rows, cols, 1)
    return np.take_along_axis(val0, cols, 1), np.stack([src_m, cols]).astype(np.int32)  # kept per block


def _backtrack(trail, m: int, h: int) -> tuple[Choice, ...]:
    out = []
    for opts, arg, src in reversed(trail):
        m, h = int(src[0, m, h]), int(src[1, m, h])
        lv, hl, _, c = opts[int(arg[m, h])]
        out.append(c)
        m, h = m - lv, h - hl
    return tuple(reversed(out))


def greedy(pb: Problem) -> Solution | None:
    """H3T Alg. 2: start from every block's fastest choice; while over budget, take the switch
    that frees the most memory (device and host units) per second it adds."""
    results = []
    for window, stream_ok, cap, hcap in _variants(pb):
        opts = [_options(pb, i, window, stream_ok) for i in range(len(pb.profile.blocks))]
        pick = [min(range(len(o)), key=lambda k, o=o: o[k][2]) for o in opts]

        def over() -> tuple[int, int]:
            return (max(0, sum(o[k][0] for o, k in zip(opts, pick)) - cap),
                    max(0, sum(o[k][1] for o, k in zip(opts, pick)) - hcap))

        while any(over()):
            excess = over()

            def freed(i: int, k: int) -> int:
                """Units of the excess a move frees; moves that grow either memory are not taken."""
                cur, alt = opts[i][pick[i]], opts[i][k]
                if alt[0] > cur[0] or alt[1] > cur[1]:
                    return 0
                return min(cur[0] - alt[0], excess[0]) + min(cur[1] - alt[1], excess[1])

            moves = [(i, k) for i in range(len(opts)) for k in range(len(opts[i])) if freed(i, k) > 0]
            if not moves:
                break
            i, k = max(moves, key=lambda m: freed(*m) / max(opts[m[0]][m[1]][2] - opts[m[0]][pick[m[0]]][2], 1e-12))
            pick[i] = k
        results.append(evaluate(pb, tuple(opts[i][pick[i]][3] for i in range(len(opts))), window, "greedy"))
    return _best(results)


def random_search(pb: Problem, samples: int = 256, seed: int = 0) -> Solution | None:
    """H3T's random solver: the best of ``samples`` uniformly drawn assignments."""
    rng = random.Random(seed)
    n = len(pb.profile.blocks)
    choices = choices_for(pb.profile)
    return _best(evaluate(pb, tuple(rng.choice(choices) for _ in range(n)), rng.choice(pb.windows), "random")
                 for _ in range(samples))


def stronghold(pb: Problem) -> Solution | None:
    """STRONGHOLD §III-D: stream every block, states on the host, and the smallest window whose
    prefetches hide behind compute, 1 + ceil(copy time / compute time), as memory allows."""
    p = pb.profile
    b = max(p.blocks, key=lambda b: b.params)
    want = 1 + math.ceil(b.params * p.compute_bytes / p.machine.h2d_bps / max(b.forward_s, 1e-12))
    choice = Choice(stream=True, recompute=False, offload_hidden=False, device_home=False)
    for window in range(max(want, 1), 0, -1):
        s = evaluate(pb, (choice,) * len(p.blocks), window, "stronghold")
        if s is not None:
            return s
    return None


def exhaustive(pb: Problem) -> Solution | None:
    """Every assignment and window: the reference the tests hold the DP to (tiny models only)."""
    n = len(pb.profile.blocks)
    return _best(evaluate(pb, combo, w, "exhaustive") for w in pb.windows
                 for combo in itertools.product(choices_for(pb.profile), repeat=n))


SOLVERS = {"dp": dynamic_programming, "greedy": greedy, "random": random_search, "stronghold": stronghold}
