"""``tiertrain plan --max-model``: the largest GPT-3-shaped model a machine trains with any plan, the
figure the papers lead with (STRONGHOLD: 39.5B on one 32 GB V100), beside the capacity bound
(device + host + disk) / 16 bytes per parameter.

The family: GPT-3's shape (ANGEL-PTM Table 4, FOLD3D Table 1): heads of 128, a 4x MLP, vocabulary
50257, d_model = 128 x n_layer as GPT-3 6.7B, 13B and 175B have it. The search takes the deepest
member that fits, then deepens that width while it still fits (a model past the family's next width
may still fit deeper). A model fits when the DP finds any plan within the budgets
(``planner.auto.fits``); each is planned from its FLOP-and-bytes estimate at the machine's rates,
so no model is built or run, and the answer's predicted step comes from every solver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tiertrain.errors import UserError
from tiertrain.measure.analytic import analytic_profile
from tiertrain.models.accounting import param_count
from tiertrain.models.config import ModelConfig
from tiertrain.parallel.tensor_plans import whole_per_block
from tiertrain.plan import Budgets
from tiertrain.plan.fit import capacity_params, within_capacity
from tiertrain.planner.auto import Candidate, choose, fits, run_profile, solvable
from tiertrain.planner.machine import Machine
from tiertrain.planner.network import Network
from tiertrain.planner.profile import Profile
from tiertrain.planner.solvers import Problem
from tiertrain.planner.tensor import for_tensor

HEAD_DIM = 128
VOCAB = 50257


def gpt3_shape(layers: int, width: int | None = None, seq: int = 2048) -> ModelConfig:
    """A GPT-3-shaped model of ``layers`` blocks; ``width`` defaults to the family's 128 x layers."""
    d = width or HEAD_DIM * layers
    return ModelConfig(n_layer=layers, n_head=max(1, d // HEAD_DIM), d_model=d, d_ffn=4 * d, vocab_size=VOCAB,
                       max_seq_len=max(2048, seq), name=f"gpt3-shape-{layers}x{d}")


@dataclass(frozen=True)
class Cluster:
    """The ranks a --max-model answer spans: each block cut over ``tp`` ranks of a node (over a link of
    ``tp_bps``), the shards' states split over the ``network.dp`` ranks holding each (ZeRO-3-like)."""

    tp: int
    tp_bps: float
    network: Network

    @property
    def ranks(self) -> int:
        return self.tp * self.network.dp


@dataclass(frozen=True)
class RunShape:
    """What each candidate is planned for: the run's batch shape, precision and update mode."""

    batch: int
    seq: int
    precision: str
    update: str
    needs_all_grads: bool
    max_staleness: int
    page: int
    levels: int | None = None   # the DP's device levels (default: 4 per block, at least 128)
    cluster: Cluster | None = None  # several ranks (None: one process)

    @property
    def ranks(self) -> int:
        return self.cluster.ranks if self.cluster is not None else 1

    @property
    def tp(self) -> int:
        return self.cluster.tp if self.cluster is not None else 1


@dataclass(frozen=True)
class Largest:
    cfg: ModelConfig
    params: int
    chosen: Candidate
    candidates: list[Candidate]
    profile: Profile
    family: ModelConfig          # the family's largest before deepening
    sizes: Budgets               # each rank's
    run: RunShape

    @property
    def bound_params(self) -> int:
        """The capacity bound of every rank together."""
        return capacity_params(self.sizes) * self.run.ranks


class NothingFits(UserError):
    """Not even the smallest model of the family fits the machine."""


def profile_for(cfg: ModelConfig, machine: Machine, run: RunShape) -> Profile:
    """One rank's profile of ``cfg``: its share of each block under tensor parallel, and the ranks its
    shards' states are split over."""
    profile = analytic_profile(cfg, run.batch, run.seq, run.precision, machine=machine)
    profile = run_profile(dataclasses.replace(profile, page=run.page), run.update, run.max_staleness,
                          run.needs_all_grads, group=run.cluster is not None and run.cluster.tp > 1)
    if run.cluster is None:
        return profile
    c = run.cluster
    return dataclasses.replace(for_tensor(profile, c.tp, c.tp_bps, whole_per_block(cfg)), network=c.network)


def model_fits(cfg: ModelConfig, machine: Machine, sizes: Budgets, run: RunShape) -> bool:
    """Whether any plan fits; over several ranks, whether the DP's plan also resolves there (the DP alone
    leaves out a sharded block's gathered copy beside its slot, which the resolved plan counts)."""
    pb = Problem.sized(profile_for(cfg, machine, run), sizes, run.levels)
    if run.cluster is None:
        return fits(pb)
    return fits(pb) and solvable(pb, run.update, run.needs_all_grads, run.max_staleness)


def last_fitting(lo: int, hi: int, fit: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi) with fit(n), given fit(lo), not fit(hi) and fit monotone."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    return lo


def _gallop(lo: int, limit: int, fit: Callable[[int], bool]) -> int:
    """``last_fitting`` from ``lo`` upwards in steps 1, 2, 4, ...: cheap where the answer is near
    ``lo`` (a deeper model is planned with more blocks, so probing far above costs the most)."""
    step = 1
    while lo + step < limit and fit(lo + step):
        lo, step = lo + step, 2 * step
    return last_fitting(lo, min(lo + step, limit), fit)


def beyond_capacity(sizes: Budgets, params: Callable[[int], int], ranks: int = 1) -> int:
    """The first n whose model exceeds the capacity bound of ``ranks`` ranks of ``sizes`` each: it cannot
    fit, so the search stops there."""
    n = 1
    while within_capacity(params(n) // ranks, sizes):
        n *= 2
    return n


def largest_model(machine: Machine, sizes: Budgets, run: RunShape) -> Largest:
    """The largest family member that fits, deepened at its width while it fits, and its best plan. Under
    tensor parallel the family's depths are multiples of tp (its heads, one per 128 of width, divide
    over the group)."""
    tp = run.tp

    def member(k: int) -> ModelConfig:
        return gpt3_shape(k * tp, seq=run.seq)

    if not model_fits(member(1), machine, sizes, run):
        raise NothingFits(f"not even a {tp}-block GPT-3-shaped model (width {HEAD_DIM * tp}) fits {machine.name} "
                          f"with device {sizes.device >> 20} MiB, host {sizes.host >> 20} MiB, disk "
                          f"{sizes.disk >> 20} MiB a rank at this batch shape; give more memory, a disk, or a "
                          "smaller --batch/--seq")
    top = beyond_capacity(sizes, lambda k: param_count(member(k)), run.ranks)
    layers = tp * last_fitting(1, top, lambda k: model_fits(member(k), machine, sizes, run))
    width = HEAD_DIM * layers
    deeper = beyond_capacity(sizes, lambda n: param_count(gpt3_shape(n, width, run.seq)), run.ranks)
    deep = _gallop(layers, deeper, lambda n: model_fits(gpt3_shape(n, width, run.seq), machine, sizes, run))
    cfg = gpt3_shape(deep, width, run.seq)
    profile = profile_for(cfg, machine, run)
    chosen, cands = choose(Problem.sized(profile, sizes, run.levels), update=run.update,
                           needs_all_grads=run.needs_all_grads, max_staleness=run.max_staleness)
    return Largest(cfg, param_count(cfg), chosen, cands, profile, gpt3_shape(layers, seq=run.seq), sizes, run)
