"""Which rank was lost, when a collective fails: every rank keeps a heartbeat in the process group's
store (torchrun's agent hosts it, so it outlives the workers), and a rank whose collective fails
names the ranks whose heartbeat stopped, instead of hanging or printing a socket error.

A dead peer closes its sockets, so gloo fails the collective at once; a peer that stops without
closing them (a frozen machine) is found by the collective timeout (``parallel.group.TIMEOUT``).
"""

from __future__ import annotations

import threading
import time

from tiertrain.errors import UserError

BEAT_S = 1.0
STALE_S = 4 * BEAT_S


class RankLost(UserError):
    """Another rank of the run stopped: this one cannot go on alone."""

    exit_code = 1


class Heartbeat:
    def __init__(self, store, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="tiertrain-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"tiertrain/alive/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending either way
                return

    def lost(self) -> list[int]:
        """The ranks whose heartbeat is older than ``STALE_S`` (waiting that long first, so a rank that
        died just now has stopped beating)."""
        time.sleep(STALE_S)
        now, out = time.time(), []
        for r in range(self.world):
            try:
                last = float(self.store.get(f"tiertrain/alive/{r}").decode())
            except Exception:  # noqa: BLE001 - no heartbeat at all: that rank never got this far
                last = 0.0
            if now - last > STALE_S and r != self.rank:
                out.append(r)
        return out

    def close(self) -> None:
        self._stop.set()


def lost_message(heartbeat: Heartbeat | None, exc: BaseException) -> str:
    lost = heartbeat.lost() if heartbeat is not None else []
    who = (f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {heartbeat.world}" if lost
           else "another rank")
    return (f"{who} stopped (its process is gone or frozen), so this rank stops too: "
            f"{_reason(exc)}; restart the run with --resume from its last checkpoint")


def _reason(exc: BaseException) -> str:
    """The transport's words, without its source paths: 'Connection reset by peer', a timeout."""
    text = " ".join(str(exc).split())
    return (text.split("] ", 1)[-1] if text.startswith("[") else text)[:120]
