"""What a block's forward starts for other blocks, ahead of their use.

Disk reads (ANGEL-PTM's trigger points): the states of the blocks backward reaches first start in
from disk as soon as their last write-back has landed, so the disk keeps working through the forward,
where it would otherwise wait for backward's first trigger; once those are in and no update or
write-back runs, the next ones into the update workers' places, where updates follow backward
(``plan.reads``, the same rule the simulator applies).
Gathers (ZeRO-2): a resident sharded block's updated shards are gathered while the resident block
before it computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiertrain.plan import Plan
from tiertrain.plan.reads import forward_reads
from tiertrain.runtime.backward import BackwardPass
from tiertrain.runtime.step_clock import StepClock

if TYPE_CHECKING:
    from tiertrain.runtime.block_group import BlockGroup
    from tiertrain.runtime.modes.base import UpdateMode
    from tiertrain.runtime.state_moves import StateMoves


class ReadAhead:
    def __init__(self, groups: list["BlockGroup"], plan: Plan, clock: StepClock, mode: "UpdateMode",
                 moves: "StateMoves", backward: BackwardPass, token_dependent: set[int]) -> None:
        """``token_dependent``: the groups whose gradients depend on the tokens a step routes (experts)."""
        self._clock, self._mode, self._moves, self._backward = clock, mode, moves, backward
        reads = forward_reads(plan)
        self._backward_first = [groups[i] for i in reads.first]
        self._while_idle = [groups[i] for i in reads.while_idle]
        read = [*self._backward_first, *self._while_idle]
        self._read_ids = {g.index for g in read}
        self._reads_experts = any(g.index in token_dependent for g in read)
        self._places = plan.read_ahead + 2 * plan.update_workers
        self._groups = groups
        resident = [g for g in groups[:-1] if g.shard is not None and not g.plan.stream]
        self._resident_after = {a.index: b for a, b in zip(resident, resident[1:])}  # ZeRO-2 blocks, forward order
        self.restart()

    def restart(self) -> None:
        """A new step: the blocks backward reaches first may be read in during its forward again."""
        self._unread, self._idle_unread = list(self._backward_first), list(self._while_idle)

    def forward_began(self, g: "BlockGroup") -> None:
        """``g``'s forward began (its params are in): the next resident block's gather, and disk reads.
        Neither in a recompute's forward: the blocks' updates may have run already (overlap's publish
        then, rank by rank)."""
        following = self._resident_after.get(g.index)
        if following is not None and not self._backward.running:
            following.gather_ahead()
        if self._clock.final_micro() and self._mode.reads_ahead and not self._backward.running:
            self._read_during_forward()

    def _read_during_forward(self) -> None:
        self._unread = [g for g in self._unread if self._moves.reading_full() or not self._moves.read_ahead(g, block=False)]
        if self._unread or not self._idle_unread or not self._updates_follow_backward() or not self._updates_idle():
            return
        while self._idle_unread and self._moves.read_ahead(self._idle_unread[0], block=False, places=self._places):
            self._idle_unread.pop(0)

    def _updates_follow_backward(self) -> bool:
        """Whether every block forward may read is updated in backward order, as its backward ends: where
        the mode updates blocks during backward, once a backward has shown each of them flushing as its
        gradients came in. One that flushes only when backward ends (a parameter that got no gradient;
        reduced at the end) is updated after blocks that were not read in, while holding its place: the
        host would hold more than the budget counts. Never with experts, whose gradients depend on the tokens."""
        late = self._backward.late_flushes
        if not self._mode.updates_in_backward_order or late is None:
            return False
        return not self._reads_experts and not self._read_ids & late

    def _updates_idle(self) -> bool:
        """No update runs or waits, and every write-back has landed."""
        return all(g.update_idle() for g in self._groups) and self._moves.written()
