"""The update modes, one small object each behind ``base.UpdateMode``, chosen once per run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiertrain.runtime.modes.base import UpdateMode
from tiertrain.runtime.modes.lockfree import LockfreeMode
from tiertrain.runtime.modes.overlap import OverlapMode
from tiertrain.runtime.modes.sync import SyncMode

if TYPE_CHECKING:
    from tiertrain.runtime.runtime import Runtime

MODES: dict[str, type[UpdateMode]] = {"sync": SyncMode, "overlap": OverlapMode, "lockfree": LockfreeMode}


def make_mode(rt: "Runtime") -> UpdateMode:
    return MODES[rt.plan.update](rt, rt.plan.update_workers)


__all__ = ["MODES", "LockfreeMode", "OverlapMode", "SyncMode", "UpdateMode", "make_mode"]
