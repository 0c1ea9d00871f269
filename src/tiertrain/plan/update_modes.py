"""What the three update modes mean for the bytes a run holds and the time a step takes, as data: the
one place below the runtime that tells them apart (the runtime's mode objects, ``runtime.modes``,
are the other). The byte rules, the fit and the simulator ask these rules, never the mode's name.

``sync``: every block is updated when the step is taken, and the step returns when all are done.
``overlap`` (STRONGHOLD): updates run on CPU workers while the device goes on, as soon as a block's
gradients are final where nothing needs them all first (clipping, accumulation, fp16's check).
``lockfree`` (ANGEL-PTM Alg. 2): an update loop per block takes gradients as they come; params may
lag ``max_staleness`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiertrain.errors import ConfigError

if TYPE_CHECKING:
    from tiertrain.plan.plan import Plan

UPDATE_MODES = ("sync", "overlap", "lockfree")


@dataclass(frozen=True)
class ModeRules:
    name: str
    waits_at_step: bool        # the step returns once every update is done (nothing hides behind the next step)
    updates_as_final: bool     # a block is updated as soon as its gradients are final, during backward
    loops: bool                # an update loop takes gradients whenever they come: params may lag, a step's
    #                            gradients may wait beside the next step's, the master may be moving while read
    reads_ahead: bool          # disk states are read in ahead of their update during forward and backward


RULES = {
    "sync": ModeRules("sync", waits_at_step=True, updates_as_final=False, loops=False, reads_ahead=True),
    "overlap": ModeRules("overlap", waits_at_step=False, updates_as_final=True, loops=False, reads_ahead=True),
    "lockfree": ModeRules("lockfree", waits_at_step=False, updates_as_final=True, loops=True, reads_ahead=False),
}


def rules(update: str) -> ModeRules:
    if update not in RULES:
        raise ConfigError(f"update mode {update!r} is not one of {', '.join(UPDATE_MODES)}")
    return RULES[update]


def transient(update: str, needs_all_grads: bool) -> bool:
    """Whether a run updates each block's gradients away as backward makes them, so the host need not
    hold them all: a mode that updates a block as its gradients are final, where no step needs every
    gradient first (``RunOptions.needs_all_grads``), and whose updates follow backward (not a loop's)."""
    r = rules(update)
    return r.updates_as_final and not r.loops and not needs_all_grads


def updates_during_backward(update: str, needs_all_grads: bool) -> bool:
    """Whether blocks are updated while backward still runs (the simulator's timeline)."""
    return not rules(update).waits_at_step and not needs_all_grads


def grad_copies(update: str, max_staleness: int) -> int:
    """Gradient chunks a block may hold at once. A loop with staleness allowed: the chunk the block's
    update loop took and is applying, and the one backward fills meanwhile (steps add into it until the
    loop takes it). Elsewhere one: at staleness 0 the next forward waits for the update, and the other
    modes update between backward and the next step's gradients."""
    return 2 if rules(update).loops and max_staleness > 0 else 1


def steps_per_disk_pass(update: str, max_staleness: int) -> int:
    """Steps of gradients a disk-homed block's update pass takes: one, except for an update loop, which
    waits for ``max_staleness`` steps of them (each pass costs the states' disk traffic whatever it
    carries), so its disk traffic, AdamW and publish come once every that many steps. The runtime passes
    so; the simulator and the solvers charge each step that share."""
    return max(1, max_staleness) if rules(update).loops else 1


def disk_passes_per_step(update: str, max_staleness: int) -> float:
    """A disk-homed block's update passes per step (``steps_per_disk_pass``, inverted)."""
    return 1 / steps_per_disk_pass(update, max_staleness)


LAG_FIX = "give --max-staleness 1 (a fixed lag of one step) or 0, or use --update sync or overlap"


def lags_one_step(update: str, max_staleness: int) -> bool:
    """Whether a run's updates lag exactly as far as a fixed lag holds them (``fixed_lag``): a loop's, at
    max staleness 1."""
    return rules(update).loops and max_staleness == 1


def lags_apart(update: str, max_staleness: int) -> bool:
    """Whether a run's updates may lag further than a fixed lag holds them: a free loop's, at max staleness
    2 or more, whose ranks would read a block at ages of their own (``check_group_reads_alike``)."""
    return rules(update).loops and max_staleness > 1


def fixed_lag(plan: Plan) -> bool:
    """Whether a plan's lockfree loop runs exactly one step behind (``Plan.fixed_lag``): each update
    publishes the params of the update before it and keeps its own in the master, so every forward reads
    params one step old, on every rank alike. A streamed block's compute params then live apart from its
    fp32 master, and a resident block's slot is never its master (``plan.bytes``)."""
    return plan.fixed_lag and lags_one_step(plan.update, plan.max_staleness)


def check_group_reads_alike(update: str, max_staleness: int, fix: str = LAG_FIX) -> None:
    """Refuse an update loop allowed to lag more than one step in a tensor-parallel run, whose group of
    ranks must read each block's params at one age (``fix``: the way out, in the caller's spelling; the
    command line's by default): each rank's free loop runs on its own clock, so one rank may read a block
    one step older than the other, and the parameters every rank holds whole (norms, biases) would part.
    At staleness 1 the group runs at a fixed lag (``fixed_lag``): every rank reads the same version; at 0
    every block waits for its own update before it is used, on every rank alike."""
    if lags_apart(update, max_staleness):
        raise ConfigError(f"the {update} update mode with max staleness {max_staleness} lets each rank read params "
                          f"of another age, and a tensor-parallel group's ranks must read the same: {fix}")


def check_update_mode(update: str, compute_dtype: str, grad_accum: int, clips: bool) -> None:
    """Refuse the update modes a run's other options contradict, before anything is planned or allocated."""
    r = rules(update)
    if r.loops and compute_dtype == "fp16":
        raise ConfigError(f"{update} updates start before the step's gradients can be checked for fp16 overflow; "
                          f"use --precision bf16 with {update}, or --update overlap with fp16")
    if r.loops and (grad_accum != 1 or clips):
        raise ConfigError(f"{update} updates take gradients as they come: use grad_accum 1 and no clipping "
                          "(grad_clip: 0), or --update overlap")
