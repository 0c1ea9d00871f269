"""What a failed collective means: every rank keeps a heartbeat in the process group's store
(torchrun's agent hosts it, so it outlives the workers), and a rank whose collective fails names the
ranks whose heartbeat stopped, instead of hanging or printing a socket error. Where every heartbeat
goes on, no rank was lost: the failure is the collective's own (ranks that issued different
collectives, a timeout, a backend error), and it is reported as that, on the rank that saw it.

A dead peer closes its sockets, so gloo fails the collective at once; a peer that stops without
closing them (a frozen machine) is found by the collective timeout (``parallel.group.TIMEOUT``).
Ranks that issue collectives of different shapes are caught by torch itself under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (it compares each collective's fingerprint across ranks first);
without it gloo aborts the process on such a mismatch, and NCCL may hang.
"""

from __future__ import annotations

import os
import re
import threading
import time

from tiertrain.errors import UserError

BEAT_S = 1.0
STALE_S = 4 * BEAT_S


class RankLost(UserError):
    """Another rank of the run stopped: this one cannot go on alone."""

    exit_code = 1


class CollectiveFailed(UserError):
    """A collective failed while every rank of the run is alive: the failure is the call's own."""

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


def failure(heartbeat: Heartbeat | None, exc: BaseException, call: str, lost: list[int] | None = None) -> UserError:
    """What the failure of ``call`` (a collective's name) on this rank is: ``RankLost`` naming the ranks
    whose heartbeat stopped, or, where none did (or nothing beats: a lost rank cannot be told), the
    collective's own failure in the backend's words. ``lost``: the ranks found stopped already."""
    if lost is None:
        lost = heartbeat.lost() if heartbeat is not None else []
    if lost:
        who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {heartbeat.world}"
        return RankLost(f"{who} stopped (its process is gone or frozen), so this rank stops too: "
                        f"{_reason(exc, 120)}; restart the run with --resume from its last checkpoint")
    rank = f" on rank {heartbeat.rank}" if heartbeat is not None else ""
    hint = ("" if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" else
            "; if the ranks may have issued different collectives (started with different settings, or a bug), "
            "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL: torch then compares each collective across the ranks")
    return CollectiveFailed(f"{call} failed{rank} while every rank is alive: {_reason(exc, 600)}{hint}")


def _reason(exc: BaseException, limit: int) -> str:
    """The backend's words, without its source paths ('Connection reset by peer', a timeout) or the
    tensor options torch prints for each side of a mismatch (the shapes and dtypes are kept)."""
    text = " ".join(str(exc).split())
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    text = re.sub(r", TensorDeviceTypes=TensorOptions\((?:[^()]|\([^()]*\))*\)", "", text)
    return text[:limit]
