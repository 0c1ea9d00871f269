"""The plan: how a step runs, as data (JSON in and out). The runtime decides nothing itself.

Per block: where its fp32 master and Adam moments live between steps (``home``), whether
its compute parameters stream through the device window or keep a device slot of their
own (``stream``: released between forward and backward unless the cache keeps them), and
H3T's activation switches (``recompute``, ``offload_hidden``).
For the whole step: the window size (STRONGHOLD: device slots shared by streamed
blocks) and the device cache (more slots, Belady eviction over the recorded access
order), how many accesses ahead a prefetch is triggered (0: lazy, fetched on use), the
update mode and the compute dtype.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tiertrain import typed
from tiertrain.errors import ConfigError
from tiertrain.plan.parallel import ParallelLayout
from tiertrain.plan.tiers import Tier
from tiertrain.plan.update_modes import UPDATE_MODES, lags_apart, lags_one_step, rules
from tiertrain.precisions import PRECISIONS as COMPUTE_DTYPES
from tiertrain.typed import at_least, one_of

REDUCE_DTYPES = ("fp32", "bf16")
REDUCE_EVERY = ("micro-batch", "step")

BUILTIN_PLANS = ("resident", "stream", "max-offload")


@dataclass(frozen=True)
class BlockPlan:
    home: Tier = Tier.HOST       # fp32 master + exp_avg + exp_avg_sq between steps
    stream: bool = False         # compute params borrow a window slot instead of owning one
    recompute: bool = False      # keep only the block input; recompute the rest in backward
    param_copy: bool = False     # disk home: keep the compute params on the host too (4 B/param of host
    #                              buys not reading them from disk twice a step; ANGEL-PTM's layout)
    offload_hidden: bool = False  # saved activations (with recompute: the block's input) wait on the host
    shard: bool = False          # data parallel: master, moments and gradients split over the dp ranks (the
    #                              compute params gathered into the slot at use); else replicated on every rank
    host_master: bool = False    # disk home: the fp32 master stays on the host (4 B/param), only the moments go to
    #                              disk: the update neither reads nor writes it, and an fp32 slot is filled from it
    #                              (ANGEL-PTM places each page by itself; this keeps the 4 B that spare 16 B of traffic)
    piece: int = field(default=0, metadata=at_least(0))  # disk home: the update streams the states through host
    #                              in pieces of this many bytes of each state (0: the whole block at once), so the
    #                              host needs a few pieces, not 12 B x the block; its gradients wait on the device
    streams: int = field(default=1, metadata=at_least(1))  # STRONGHOLD's multi-stream execution: the block's batch
    #                              in this many chunks, each on a device stream of its own (``runtime.streams``)

    def to_dict(self) -> dict:
        return {f: (getattr(self, f).value if f == "home" else getattr(self, f)) for f in _BLOCK_FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> "BlockPlan":
        return typed.load(cls, d, "block plan")


_BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(BlockPlan))


DEFAULT_MAX_STALENESS = 1
GRADS_HELD = ("all", "transient", "bounded")


@dataclass(frozen=True)
class Resolved:
    """What resolving a plan against the model's sizes, the budgets and the run's options decided
    (``plan.fit.resolve``): data the runtime applies and the simulator replays, never decided again.
    Written with the plan (``tiertrain plan`` shows it); a plan given to a run is resolved for that run."""

    grads: str = field(default="all", metadata=one_of(*GRADS_HELD))  # all: every block's gradient chunks held;
    #     transient: each updated away as backward makes it, and all of them fit; bounded: updated away, and
    #     backward waits for an update to free a chunk where more would not fit
    page: int = field(default=0, metadata=at_least(0))      # the page size the counts were made at
    device: int = field(default=0, metadata=at_least(0))    # bytes the plan holds per tier, as counted (the
    host: int = field(default=0, metadata=at_least(0))      # device pool maps this much of its budget)
    disk: int = field(default=0, metadata=at_least(0))
    experts: tuple[int, ...] = ()  # expert parallel: per block, the elements of the experts this rank holds

    @property
    def bounded(self) -> bool:
        return self.grads == "bounded"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"experts": list(self.experts)}


@dataclass(frozen=True)
class Plan:
    blocks: tuple[BlockPlan, ...]          # one per repeated block, in order
    rest: BlockPlan = BlockPlan()          # embeddings, head, final norm (never streamed)
    window: int = field(default=2, metadata=at_least(1))  # device slots shared by streamed blocks (STRONGHOLD)
    cache: int = field(default=0, metadata=at_least(0))   # more such slots, keeping blocks for reuse (Elixir; Belady)
    prefetch: int = field(default=1, metadata=at_least(0))  # streamed blocks fetched ahead of the one computing
    update: str = field(default="sync", metadata=one_of(*UPDATE_MODES))
    name: str = "custom"
    read_ahead: int = field(default=2, metadata=at_least(0))  # disk-homed blocks whose states are read in ahead
    update_workers: int = field(default=2, metadata=at_least(1))  # CPU optimizer threads (each holds one block's
    #                                                               states in host)
    max_staleness: int = field(default=DEFAULT_MAX_STALENESS, metadata=at_least(0))  # lockfree: steps params may lag
    fixed_lag: bool = False  # lockfree at max staleness 1: every forward reads params exactly one step old, on
    #                          every rank alike (ZeRO-Offload's delayed parameter update; a tensor-parallel group's,
    #                          sharded blocks'); inert in the other modes and at max staleness 0
    compute_dtype: str = field(default="fp32", metadata=one_of(*COMPUTE_DTYPES))  # fp32 | bf16 | fp16: the dtype of
    #                                        device params (master stays fp32; fp16 brings dynamic loss scaling)
    parallel: ParallelLayout = ParallelLayout()  # processes the run spans, and how experts are divided over them
    reduce_dtype: str = field(default="fp32", metadata=one_of(*REDUCE_DTYPES))  # data parallel: the dtype a
    #                          micro-batch's gradients are summed over the ranks in (bf16 halves the bytes sent)
    reduce_every: str = field(default="micro-batch", metadata=one_of(*REDUCE_EVERY))  # data parallel: a block's
    #                          gradients reduced over the ranks each micro-batch (a rank keeps only its part between
    #                          them) or once a step (each rank sums its micro-batches first: a pipeline's DP.sync)
    reduce_on: str = field(default="device", metadata=one_of("device", "host"))  # data parallel: where a
    #                          micro-batch's gradients are staged and reduced (over the device group, or the CPU
    #                          group where the device cannot hold two blocks' gradients: ``plan.fit.resolve``)
    beside_pool: int = field(default=0, metadata=at_least(0))  # device bytes the compute holds beside the pool
    #                          (activations, autograd's gradients), as plan auto counts them: the pool gets the
    #                          rest of the device budget (0: none kept, as in a plan written by hand)
    stash: int = field(default=0, metadata=at_least(0))  # host bytes the offloaded activations wait in (its
    #                          offload_hidden blocks'), as plan auto counts them: kept out of what resolve spends
    resolved: Resolved | None = None  # what ``plan.fit.resolve`` decided for a run (None: not resolved yet)

    def validate(self, n_blocks: int) -> "Plan":
        if len(self.blocks) != n_blocks:
            raise ConfigError(f"plan has {len(self.blocks)} block entries but the model has {n_blocks} blocks")
        if self.rest.stream:
            raise ConfigError("the rest block (embeddings, head) cannot stream; set its stream to false")
        rules(self.update)  # one of the modes
        if any(b.stream for b in self.blocks) and not 1 <= self.window:
            raise ConfigError(f"window must be at least 1 slot, got {self.window}")
        if not 0 <= self.prefetch < max(1, self.window):
            raise ConfigError(f"prefetch {self.prefetch} must be below the window {self.window}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype {self.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        pieced = [b for b in (*self.blocks, self.rest) if b.piece and b.home is not Tier.DISK]
        if pieced:
            raise ConfigError(f"a block's piece ({pieced[0].piece} bytes) streams a disk-homed block's update "
                              "through host; set piece to 0 where home is not disk")
        split = [b for b in (*self.blocks, self.rest) if b.host_master and b.home is not Tier.DISK]
        if split:
            raise ConfigError(f"host_master keeps a disk-homed block's master on the host; its home is "
                              f"{split[0].home.value}: set host_master to false or home to disk")
        if self.read_ahead < 0 or self.update_workers < 1 or self.max_staleness < 0 or self.cache < 0:
            raise ConfigError("cache, read_ahead and max_staleness must be >= 0 and update_workers >= 1")
        if self.fixed_lag:
            self._check_fixed_lag()
        return self

    def _check_fixed_lag(self) -> None:
        """A fixed lag holds one step's update in the master until the next update publishes it: a lockfree
        loop's at max staleness 1 (at 0 it is inert: every block waits for its own update; other modes
        never lag), of blocks whose master an update holds whole."""
        if lags_apart(self.update, self.max_staleness):
            raise ConfigError(f"fixed_lag runs lockfree updates exactly one step behind, but this plan lets them lag "
                              f"{self.max_staleness}: set max_staleness 1, or fixed_lag to false")
        if lags_one_step(self.update, self.max_staleness) and any(b.piece for b in (*self.blocks, self.rest)):
            raise ConfigError("fixed_lag publishes a block's params from its whole master at its next update, which a "
                              "block updated in pieces never holds: set piece to 0, or fixed_lag to false")

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def uses_disk(self) -> bool:
        return any(b.home is Tier.DISK for b in (*self.blocks, self.rest))

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "window": self.window, "cache": self.cache, "prefetch": self.prefetch,
                           "update": self.update, "read_ahead": self.read_ahead, "max_staleness": self.max_staleness,
                           **({"fixed_lag": True} if self.fixed_lag else {}),
                           "compute_dtype": self.compute_dtype,
                           "update_workers": self.update_workers, "parallel": self.parallel.to_dict(),
                           **{k: getattr(self, k) for k in ("beside_pool", "stash") if getattr(self, k)},
                           **({"resolved": self.resolved.to_dict()} if self.resolved is not None else {}),
                           "rest": self.rest.to_dict(),
                           "blocks": [b.to_dict() for b in self.blocks]}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        """Every field checked for type and range (``typed``); unknown keys refused by name."""
        return typed.load_json(cls, text, where, "write it with `tiertrain plan` or tiertrain.Plan.to_json()")


def builtin_plan(name: str, n_blocks: int, disk: bool = False, update: str = "sync", window: int = 2) -> Plan:
    """``resident``: plain, everything on the device. ``stream``: STRONGHOLD's window of
    ``window`` slots, states on the host. ``max-offload``: a window of one slot plus one
    prefetch, recompute everywhere, states on disk when there is one (else host)."""
    if name == "resident":
        return Plan(tuple(BlockPlan(home=Tier.DEVICE) for _ in range(n_blocks)), BlockPlan(home=Tier.DEVICE),
                    window=1, prefetch=0, update=update, name=name)
    if name == "stream":
        return Plan(tuple(BlockPlan(home=Tier.HOST, stream=True) for _ in range(n_blocks)), BlockPlan(home=Tier.HOST),
                    window=window, prefetch=min(1, window - 1), update=update, name=name)
    if name == "max-offload":
        home = Tier.DISK if disk else Tier.HOST
        return Plan(tuple(BlockPlan(home=home, stream=True, recompute=True) for _ in range(n_blocks)),
                    BlockPlan(home=home), window=2, prefetch=1, update=update, name=name)
    raise ConfigError(f"unknown plan {name!r}; use one of {', '.join(BUILTIN_PLANS)}, auto, or a plan JSON file")


def data_parallel(plan: Plan, world: int, shard: bool = True, ep: int = 1, shard_group: int = 0) -> Plan:
    """``plan`` over ``world`` data-parallel ranks: every block's states and gradients split over them
    (``shard``: ZeRO-3 where a block streams, ZeRO-2 where it stays on the device) or replicated on each
    (DDP). ``ep``: a mixture of experts' experts divided over groups of ``ep`` ranks (expert parallel).
    ``shard_group``: split over groups of that many ranks, replicated across them (hybrid sharding).
    A plan already laid out so is returned as it is."""
    layout = ParallelLayout(dp=world, ep=ep, shard_group=shard_group)  # refuses what does not divide the ranks
    if plan.parallel == layout:
        return plan
    blocks = tuple(dataclasses.replace(b, shard=shard) for b in plan.blocks)
    return dataclasses.replace(plan, blocks=blocks, rest=dataclasses.replace(plan.rest, shard=shard),
                               parallel=layout)


def plan_file(spec: str) -> Plan:
    """The plan in the file ``spec`` names, read and checked field by field (not yet against a model)."""
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"plan {spec!r} is neither a built-in plan ({', '.join(BUILTIN_PLANS)}) nor a file")
    return Plan.from_json(typed.read_text(path, "plan file", "give a plan JSON file"), f"plan file {path}")


def load_plan(spec: "str | Plan", n_blocks: int, disk: bool, update: str | None = None) -> Plan:
    if isinstance(spec, Plan):
        plan = spec
    elif spec in BUILTIN_PLANS:
        plan = builtin_plan(spec, n_blocks, disk, update or "sync")
    elif spec == "auto":
        raise ConfigError("plan 'auto' measures the model first: call tiertrain.setup(..., plan='auto', profile_step=fn) "
                          "with fn running one forward+backward at the training batch shape, or make a plan file with "
                          "`tiertrain plan` and pass it")
    else:
        plan = plan_file(spec)
    if update is not None:
        plan = dataclasses.replace(plan, update=update)
    return plan.validate(n_blocks)
