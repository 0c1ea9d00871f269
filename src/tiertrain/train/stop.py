"""Graceful stop: the first Ctrl-C or SIGTERM finishes the current step, saves and exits.

An interrupt in the middle of ``optimizer.step`` could leave weights updated but the step
counter not, which would break bitwise resume; so signals only raise a flag that the
loop checks between steps. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class StopFlag:
    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

