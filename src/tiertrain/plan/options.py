"""A run's settings, as one typed object: what ``tiertrain.setup`` is told besides the plan.

The training loop's contract, which the plan does not say but the runtime must know: how many
micro-batches make a step, whether the loop clips (and so needs every gradient before any update),
whether it trains at all, whether the states are written from the model or left for a checkpoint
to fill, which module list holds the blocks. And what overrides a given plan's own choices: its
update mode, staleness and compute dtype, its expert-parallel ranks, how it is laid out over the ranks,
and the page size (None: the plan's, or measured).
``tiertrain.setup`` takes it (or its fields as keywords); the runtime and the planner read it;
nothing passes these as loose arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiertrain import typed
from tiertrain.plan.plan import COMPUTE_DTYPES, REDUCE_DTYPES, REDUCE_EVERY
from tiertrain.plan.update_modes import UPDATE_MODES
from tiertrain.typed import above, at_least, one_of


@dataclass(frozen=True)
class RunOptions:
    grad_accum: int = field(default=1, metadata=at_least(1))           # micro-batches per optimizer step
    max_grad_norm: float | None = field(default=None, metadata=above(0))  # clipping declared up front; None: off
    train: bool = True              # False: forward only (a teacher larger than the device), no optimizer states
    init_states: bool = True        # False: allocate states for a checkpoint to fill (resume), draw nothing
    blocks: str | None = None       # the nn.ModuleList of blocks, when the finder should not guess
    update: str | None = field(default=None, metadata=one_of(*UPDATE_MODES))   # None: the plan's
    max_staleness: int | None = field(default=None, metadata=at_least(0))       # None: the plan's
    fixed_lag: bool | None = None   # None: the plan's; True: lockfree exactly one step behind (``Plan.fixed_lag``)
    compute_dtype: str | None = field(default=None, metadata=one_of(*COMPUTE_DTYPES))  # None: the plan's
    reduce_dtype: str | None = field(default=None, metadata=one_of(*REDUCE_DTYPES))  # None: the plan's (fp32)
    reduce_every: str | None = field(default=None, metadata=one_of(*REDUCE_EVERY))  # None: the plan's (micro-batch)
    page_size: int | None = field(default=None, metadata=at_least(4096))        # None: measured for the machine
    ep: int | None = field(default=None, metadata=at_least(1))  # None: the plan's expert-parallel ranks (1 if none)
    shard: bool | None = None       # a plan for one process laid out over the ranks: sharded (ZeRO-2/3 like, the
    #                                 default, None) or replicated (False: every rank holds every block, as DDP)
    shard_group: int | None = field(default=None, metadata=at_least(2))  # None: the plan's (else every rank); K:
    #                                 hybrid sharding, each block split over groups of K ranks, replicated across them

    def __post_init__(self) -> None:
        typed.check(self, "run options")

    @property
    def clips(self) -> bool:
        return self.max_grad_norm is not None

    def needs_all_grads(self, compute_dtype: str) -> bool:
        """Whether a step needs every gradient before any update: for the global norm (clipping), the
        fp16 overflow check, or the last micro-batch of an accumulation. An overlapped step that
        does not updates each block's gradients away as backward makes them (transient gradients)."""
        return self.clips or self.grad_accum > 1 or (compute_dtype == "fp16" and self.train)
