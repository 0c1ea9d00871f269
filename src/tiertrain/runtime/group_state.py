"""A block group's explicit states and the moves each allows (FSDP2's ``TrainingState``, split in
two because a block's gradients outlive the pass that made them).

``Pass``: where the block is in the current pass, set by its hooks. A recompute (the user's own
checkpointing, rerunning a forward inside backward), a block applied twice (shared weights) and a
forward or backward that raised are all moves the table allows; anything else is a tiertrain bug.
Staying where one is is always allowed.

``Grads``: what its gradients of the current step are. They are summed over the micro-batches (in
its grad chunk; over several ranks each micro-batch's are averaged over the ranks as its backward
leaves the block, ``REDUCING``, and their part summed there), and final once the last micro-batch's
are in the grad chunk the update takes. An update taking them, or ``zero_grad`` dropping them, brings the block back to ``NONE``.
Lockfree's loop takes them when it comes round (at once, or once enough steps have gathered), so
there a block's ``FINAL`` gradients are summed with the next step's until it does.

``Slot``: whether a resident sharded block's device slot holds its latest parameters (the update
publishes shards, which the next use gathers).
"""

from __future__ import annotations

from enum import Enum


class Pass(Enum):
    IDLE = "idle"            # between uses
    FORWARD = "forward"      # pre_forward ran: its params are on the device for its forward
    BACKWARD = "backward"    # pre_backward ran: its params are there for its backward


class Grads(Enum):
    NONE = "none"            # no gradient of this step
    SUMMING = "summing"      # some micro-batches' gradients held, more to come
    REDUCING = "reducing"    # a micro-batch's: averaging over the ranks in flight
    FINAL = "final"          # in the grad chunk, final: the update may take them


class Slot(Enum):
    FRESH = "fresh"          # the slot holds the latest params (or the cache refills it: streamed blocks)
    STALE = "stale"          # an update published new shards; the next use gathers them
    GATHERING = "gathering"  # that gather is in flight, started ahead of the block's forward


PASS_MOVES: dict[Pass, frozenset[Pass]] = {
    Pass.IDLE: frozenset({Pass.FORWARD, Pass.BACKWARD}),
    # IDLE: post_forward; BACKWARD: a recompute's forward returned, or a forward that raised is abandoned
    Pass.FORWARD: frozenset({Pass.IDLE, Pass.BACKWARD}),
    # FORWARD: a recompute inside backward (or a new forward after a backward that raised); IDLE: flushed
    Pass.BACKWARD: frozenset({Pass.IDLE, Pass.FORWARD}),
}

GRAD_MOVES: dict[Grads, frozenset[Grads]] = {
    Grads.NONE: frozenset({Grads.SUMMING, Grads.REDUCING, Grads.FINAL}),
    Grads.SUMMING: frozenset({Grads.REDUCING, Grads.FINAL, Grads.NONE}),
    Grads.REDUCING: frozenset({Grads.FINAL, Grads.SUMMING, Grads.NONE}),  # SUMMING: a micro-batch before the last
    Grads.FINAL: frozenset({Grads.NONE, Grads.SUMMING}),  # SUMMING: lockfree, the next step's beside what waits
}

SLOT_MOVES: dict[Slot, frozenset[Slot]] = {
    Slot.FRESH: frozenset({Slot.STALE}),
    Slot.STALE: frozenset({Slot.GATHERING, Slot.FRESH}),
    Slot.GATHERING: frozenset({Slot.FRESH}),
}


class IllegalMove(RuntimeError):
    """A block group asked to move between states its table does not allow: a tiertrain bug."""


def moved(table: dict, name: str, current: Enum, new: Enum) -> Enum:
    """``new``, once the table allows ``current`` -> ``new`` for the block ``name``."""
    if new is not current and new not in table[current]:
        raise IllegalMove(f"internal: block {name} cannot go from {current.value} to {new.value}; please report this")
    return new
