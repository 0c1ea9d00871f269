"""What a run's block groups share and call, given to each group at construction (FSDP2 gives its
param groups a shared ``FSDPCommContext`` the same way).

The collaborators that are built over the groups (the device cache, the update mode, the state
moves, the backward pass, the read-ahead) cannot exist before them; the runtime fills them in once
every group is built, and anew when a plan takes effect. A group reaches them only through here, and
sees each through the few calls it makes of it (the protocols below): nothing is injected into a group
as a callback, and this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tiertrain.memory import MemorySystem, Tier
from tiertrain.optim import AdamWHyper
from tiertrain.parallel import Collectives
from tiertrain.runtime.step_clock import StepClock

Group = Any  # a ``BlockGroup``: named loosely here, since the group's module imports this one


class Slots(Protocol):
    """The device cache (``runtime.cache``): a streamed block's slot."""

    def acquire(self, g: Group) -> None: ...
    def invalidate(self, g: Group) -> None: ...


class Updates(Protocol):
    """The update mode (``runtime.modes``): when params are final enough to use, what final gradients mean."""

    reads_ahead: bool
    takes_grads_any_time: bool

    def params_ready(self, g: Group) -> None: ...
    def update_due(self, g: Group) -> bool: ...
    def step_hypers(self) -> list[AdamWHyper] | None: ...
    def grads_final(self, g: Group) -> None: ...


class Moves(Protocol):
    """The state moves (``runtime.state_moves``): disk-homed states around an update."""

    def read_ahead(self, g: Group, block: bool = True, slot: Any = None, places: int | None = None) -> bool: ...
    def bring_in(self, g: Group) -> None: ...
    def send_home(self, g: Group) -> None: ...


class Backward(Protocol):
    """The backward pass (``runtime.backward``): what one block's flush means for the others."""

    def begin(self) -> None: ...
    def flushed_early(self, g: Group) -> None: ...
    def reduction_started(self, g: Group) -> None: ...
    def room_for_grads(self, tier: Tier) -> None: ...


class Ahead(Protocol):
    """The read-ahead (``runtime.read_ahead``): what a block's forward starts for the others."""

    def forward_began(self, g: Group) -> None: ...


@dataclass(eq=False)
class RunContext:
    mem: MemorySystem
    comm: Collectives
    clock: StepClock
    hypers: Callable[[], list[AdamWHyper]]  # the optimizer's hyperparameters as they are now (a snapshot)
    cache: Slots | None = None
    mode: Updates | None = None
    moves: Moves | None = None
    backward: Backward | None = None
    ahead: Ahead | None = None
    shards: Collectives | None = None  # what sharded blocks are laid out over: ``comm``, or a hybrid mesh of it
