"""The update modes, one small object each behind ``base.UpdateMode``, chosen once per run."""

from __future__ import annotations

from tiertrain.plan import Plan
from tiertrain.plan.update_modes import fixed_lag as runs_at_fixed_lag
from tiertrain.runtime.modes.base import ModeContext, UpdatableGroup, UpdateMode
from tiertrain.runtime.modes.fixed_lag import FixedLagMode
from tiertrain.runtime.modes.lockfree import LockfreeMode
from tiertrain.runtime.modes.overlap import OverlapMode
from tiertrain.runtime.modes.sync import SyncMode

MODES: dict[str, type[UpdateMode]] = {"sync": SyncMode, "overlap": OverlapMode, "lockfree": LockfreeMode}


def mode_of(plan: Plan) -> type[UpdateMode]:
    """The mode a plan runs its updates in (lockfree's loop at a fixed lag where the plan says so)."""
    return FixedLagMode if runs_at_fixed_lag(plan) else MODES[plan.update]


def make_mode(ctx: ModeContext) -> UpdateMode:
    return mode_of(ctx.plan)(ctx)


__all__ = ["MODES", "FixedLagMode", "LockfreeMode", "ModeContext", "OverlapMode", "SyncMode", "UpdatableGroup", "UpdateMode",
           "make_mode", "mode_of"]
