"""What the planner plans from: per-block times and sizes, and the machine's speeds.

A profile is a JSON file, so plans can be made offline, on another machine, or from
synthetic numbers (the tests reproduce H3T's case study that way). The planner imports
nothing from the runtime: a profile is all it knows of the model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tiertrain import typed
from tiertrain.plan.fit import Sizes
from tiertrain.planner.network import Network
from tiertrain.precisions import BYTES, PRECISIONS
from tiertrain.typed import above, at_least, one_of

_TIME = at_least(0)
_RATE = above(0)


@dataclass(frozen=True)
class BlockProfile:
    name: str
    forward_s: float = field(metadata=_TIME)      # one forward of the block
    backward_s: float = field(metadata=_TIME)     # its backward, without recompute
    params: int = field(metadata=at_least(0))     # parameter count
    act_bytes: int = field(metadata=at_least(0))  # everything autograd saves inside the block
    hidden_bytes: int = field(metadata=at_least(0))  # the block's input: all that recompute keeps
    recompute_s: float | None = field(default=None, metadata=_TIME)  # forward again in backward (None: forward_s)
    # one forward's work, to carry its times to another machine (``planner.retarget``); 0: not known
    flops: float = field(default=0.0, metadata=_TIME)          # matrix products and attention
    traffic_bytes: float = field(default=0.0, metadata=_TIME)  # element-wise memory traffic besides the weights
    largest: int = field(default=0, metadata=at_least(0))  # elements of its largest parameter (0: not known)
    experts: int = field(default=0, metadata=at_least(0))  # expert parallel: of ``params``, the experts one rank
    #                                                         holds whole (never sharded, never streamed)
    # STRONGHOLD's multi-stream execution, measured on the device: (n, the block's forward and backward over
    # n streams as a fraction of one stream's); none measured: one stream (a CPU has none to run side by side)
    stream_ratio: tuple[tuple[int, float], ...] = ()

    @property
    def shared(self) -> int:
        """Its elements laid out over the data-parallel ranks (all but the experts a rank holds)."""
        return self.params - self.experts

    @property
    def recompute_seconds(self) -> float:
        return self.forward_s if self.recompute_s is None else self.recompute_s

    def computing(self, k: float) -> "BlockProfile":
        """The block computing ``k`` times as long: forward, backward and recompute."""
        rec = None if self.recompute_s is None else self.recompute_s * k
        return dataclasses.replace(self, forward_s=self.forward_s * k, backward_s=self.backward_s * k, recompute_s=rec)


@dataclass(frozen=True)
class MachineProfile:
    h2d_bps: float = field(metadata=_RATE)        # host -> device bytes/s (pinned)
    d2h_bps: float = field(metadata=_RATE)
    disk_read_bps: float = field(metadata=_RATE)
    disk_write_bps: float = field(metadata=_RATE)
    adam_params_per_s: float = field(metadata=_RATE)  # CPU AdamW throughput on the update workers
    device_is_host: bool = False  # CPU-only: "device" memory is host RAM, copies are memcpy
    disk_cpu_s_per_byte: float = field(default=0.0, metadata=_TIME)  # CPU time the disk tier spends per byte
    # how much faster the disk reads and writes at once (half the requests each way) than in turns, as
    # the run's disk tier measured it (``engine.measure.disk_depth``) where it lets them (a write share);
    # 1: reads and writes take turns on the disk
    disk_together_gain: float = field(default=1.0, metadata=at_least(1))

    def disk_lanes(self) -> "MachineProfile | None":
        """Where reads and writes go at once: this profile with each direction's rate as the disk
        gives it beside the other, for a read lane and a write lane of their own; else None (one
        lane, in turns). With B bytes each way, in turns take B/r + B/w and at once that over the
        gain; on two lanes scaled by k they take B / (k min(r, w)): so k = gain / (min(r, w) (1/r +
        1/w)), at most 1 (beside each other neither goes faster than alone). A direction alone is
        then taken at its shared rate: pessimistic where reads run with no writes beside them."""
        if self.disk_together_gain <= 1:
            return None
        r, w = self.disk_read_bps, self.disk_write_bps
        k = min(1.0, self.disk_together_gain / (min(r, w) * (1 / r + 1 / w)))
        return dataclasses.replace(self, disk_read_bps=k * r, disk_write_bps=k * w)


@dataclass(frozen=True)
class Profile:
    blocks: tuple[BlockProfile, ...]   # the repeated blocks, in forward order
    rest: BlockProfile                 # embeddings, head, final norm
    machine: MachineProfile
    compute_dtype: str = field(default="fp32", metadata=one_of(*PRECISIONS))  # the compute params' precision
    key: str = ""                      # machine + model + batch shape it was measured for
    page: int = field(default=0, metadata=at_least(0))  # the runtime's page size: chunks take whole pages (0: unpaged)
    order: tuple[int, ...] = ()        # blocks in the order one forward called them (measured profiles)
    grad_copies: int = field(default=1, metadata=at_least(1))  # gradient chunks per block at once (plan_bytes)
    disk_passes: float = field(default=1.0, metadata=_TIME)  # a disk-homed block's update passes per step
    transient_grads: bool = False      # overlap without clipping or accumulation: few grad chunks at once
    master_moves: bool = False         # an update loop may be moving a disk-homed master while forward reads the
    #                                    params (lockfree): such a block keeps its compute params on the host too
    fixed_lag: bool = False            # lockfree one step behind (``Plan.fixed_lag``): every streamed block keeps its
    #                                    compute params apart from its master, a resident one's slot is never its master
    read_ahead: int = field(default=2, metadata=at_least(0))  # the plan's disk-homed blocks read in ahead
    update_workers: int = field(default=2, metadata=at_least(1))  # the plan's optimizer threads (Plan.update_workers)
    source: str = ""                   # how its block figures were found (measured, reduced shape, estimate)
    network: Network = Network()       # the ranks planned for (per-rank budgets) and their collectives' rates
    piece: int = field(default=0, metadata=at_least(0))  # disk-homed blocks updated through host in pieces of
    #                                  this many bytes per state, their gradients waiting on the device (0: whole)
    busy: float = field(default=0.0, metadata=at_least(0))  # cores others took while its blocks were measured
    #                                  (such a profile is used once, not cached: it reads every block slow)
    micro_in_flight: int = field(default=1, metadata=at_least(1))  # micro-batches whose saved activations the
    #                                  compute holds at once (a pipeline stage's, by its schedule; 1 otherwise)
    stash_ahead: bool = False          # one micro-batch's offloaded checkpoints come back ahead of their backward
    #                                  (a pipeline's prefetch, FOLD3D §4), beside the one computing
    micro_batches: int = field(default=1, metadata=at_least(1))  # a pipeline stage's: its blocks' times are the
    #                                  step's, their activations one micro-batch's (each micro-batch's stash moves)
    gather_in_s: float = field(default=0.0, metadata=_TIME)  # sequence parallel: the seconds each way (forward,
    #                                  backward) a pipeline stage after the first gathers its input whole a step
    gather_out_s: float = field(default=0.0, metadata=_TIME)  # and a stage before the last its output (GPT-2)

    @property
    def step_flops(self) -> float:
        """One training step's matrix products and attention without recompute (forward, and backward
        twice it), as the blocks record them; 0 where they do not."""
        return 3 * sum(b.flops for b in (*self.blocks, self.rest))

    @property
    def compute_bytes(self) -> int:
        """Bytes per compute parameter (fp32 4, bf16/fp16 2)."""
        return BYTES[self.compute_dtype]

    @property
    def grad_transient_bytes(self) -> int:
        """Autograd's gradient of the largest parameter, in the compute dtype, beside the pools until the
        runtime moves it in as it arrives (``BlockGroup.grad_arrived``): a GPT-3 1.7B block's MLP
        matrix, 85 MB. A lockfree block keeps its whole set there until it flushes; a block that did not
        record its largest parameter counts all of its own. The rest's head and embedding make theirs
        in its grad chunk (``runtime.in_place_grads``) where updates take gradients away as backward
        makes them in one fp32 process on a CPU-only machine (the runtime writes them so in more runs,
        on a GPU where the rest's gradients stay on it too; the profile cannot tell them apart); elsewhere
        the head's counts, 463 MB for the 1.7B. Where gradients are bounded and the rest's chunk has no
        place of its own (it is no larger than a block's), the head's waits in autograd uncounted: at most
        a block's chunk."""
        in_place = self.transient_grads and not self.master_moves and not self.network.parallel \
            and self.compute_dtype == "fp32" and self.machine.device_is_host
        blocks = self.blocks if in_place else (*self.blocks, self.rest)
        one = max(b.params if self.master_moves or not b.largest else b.largest for b in blocks)
        return one * self.compute_bytes

    def sizes(self) -> Sizes:
        """What its blocks hold, as ``plan.fit`` counts it: each block's elements and, under expert
        parallel, the experts a rank holds of each apart (a group of their own)."""
        every = (*self.blocks, self.rest)
        experts = tuple(b.experts for b in every) if any(b.experts for b in every) else ()
        return Sizes(tuple(b.shared for b in every), experts)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> "Profile":
        return typed.load_json(cls, text, where, "write one with `tiertrain plan --model ... --profile FILE`")

    @classmethod
    def load(cls, path: Path) -> "Profile":
        text = typed.read_text(path, "profile", "run `tiertrain plan` without --profile to measure one")
        return cls.from_json(text, f"profile {path}")


def with_experts(p: Profile, sizes: Sizes) -> Profile:
    """The profile of one rank of an expert-parallel run: each block without the experts other ranks hold
    (``sizes``: what ``runtime.blocks.block_sizes`` counts at the run's ep, the block's shared elements
    and the experts this rank holds). The times stay the whole block's: a rank runs its experts on every
    rank's tokens routed to them, as many as one process runs on its own."""
    every = (*p.blocks, p.rest)
    if not sizes.experts:
        return p
    if len(sizes.numels) != len(every):
        raise ValueError(f"{len(sizes.numels)} block sizes for a profile of {len(every)} blocks")
    made = [dataclasses.replace(b, params=n + e, experts=e) for b, n, e in zip(every, sizes.numels, sizes.experts)]
    return dataclasses.replace(p, blocks=tuple(made[:-1]), rest=made[-1])
