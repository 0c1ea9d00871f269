"""What a run's block groups share and call, given to each group at construction (FSDP2 gives its
param groups a shared ``FSDPCommContext`` the same way).

The collaborators that are built over the groups (the device cache, the update mode, the state
moves, the backward pass, the read-ahead) cannot exist before them; the runtime fills them in once
every group is built, and anew when a plan takes effect. A group reaches them only through here:
nothing is injected into a group as a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiertrain.memory import MemorySystem
from tiertrain.optim import AdamWHyper
from tiertrain.parallel import Collectives
from tiertrain.runtime.step_clock import StepClock

if TYPE_CHECKING:
    from tiertrain.runtime.backward import BackwardPass
    from tiertrain.runtime.cache import DeviceCache
    from tiertrain.runtime.modes.base import UpdateMode
    from tiertrain.runtime.read_ahead import ReadAhead
    from tiertrain.runtime.state_moves import StateMoves


@dataclass(eq=False)
class RunContext:
    mem: MemorySystem
    comm: Collectives
    clock: StepClock
    hypers: Callable[[], list[AdamWHyper]]  # the optimizer's hyperparameters as they are now (a snapshot)
    cache: "DeviceCache | None" = None
    mode: "UpdateMode | None" = None
    moves: "StateMoves | None" = None
    backward: "BackwardPass | None" = None
    ahead: "ReadAhead | None" = None
