"""Per-step figures: the JSONL metrics file, and what the user sees while training runs."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from tiertrain.checkpoint.atomic import write_atomic
from tiertrain.units import format_bytes


@dataclass
class StepMedians:
    """Figures of the steps after warm-up, by name, for the run's summary: its medians (one slow
    step, a checkpoint's or a probe's neighbour, does not move them)."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        got = self.values.get(name)
        return statistics.median(got) if got else None

    def medians(self, names: tuple[str, ...]) -> dict[str, float]:
        return {n: statistics.median(self.values[n]) for n in names if self.values.get(n)}


def peak_bytes(device: torch.device) -> dict[str, int]:
    """Peak bytes per tier so far: the CUDA allocator's peak, and the process's peak RSS."""
    peaks = {"host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peaks["device"] = torch.cuda.max_memory_allocated(device)
    return peaks


def process_rss(status: Path = Path("/proc/self/status")) -> dict[str, int]:
    """The process's resident memory now and at its highest (``VmRSS``, ``VmHWM``), in bytes: what the
    machine (and a cgroup cap) sees the run hold, beside the tiers' page peaks, which count only the
    pools. A budget sized to the machine is honest only if this stays near the budgets. Where there is
    no /proc, the peak alone, from getrusage."""
    fields = {"VmRSS:": "now", "VmHWM:": "peak"}  # "VmRSS:\t  123456 kB"
    try:
        lines = status.read_text().splitlines()
    except OSError:
        return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key + ":" in fields:
            out[fields[key + ":"]] = int(value.split()[0]) * 1024  # reported in kB
    return out


def restart_rss_peak(clear_refs: Path = Path("/proc/self/clear_refs")) -> int | None:
    """Start the process's RSS peak (``VmHWM``) again from what it holds now; the peak before. Setup
    holds the caller's whole model beside the pools it fills, a peak no step sees again: the steps'
    own peak is what budgets sized to the machine must cover, so each is reported apart. None where
    the peak cannot be restarted (no /proc, or not Linux's)."""
    before = process_rss().get("peak")
    try:
        clear_refs.write_text("5\n")  # Linux: VmHWM := VmRSS
    except OSError:
        return None
    return before


def device_peak_with_activations(pages_peak: int, pool_bytes: int, device: torch.device) -> int | None:
    """With CUDA: the device pool's page peak plus the most torch allocated beside the pool
    (activations, gradients before they leave): the figure the planner's device peak predicts there.
    None elsewhere: on CPU the planner leaves activations out, and the page peak is the figure."""
    if device.type != "cuda":
        return None
    return pages_peak + max(0, torch.cuda.max_memory_allocated(device) - pool_bytes)


class MetricsFile:
    """``OUT/metrics.jsonl``: one JSON object per optimizer step, only ever appended to.

    On resume the rows of steps past the resumed one (which the run is about to redo) and a torn
    last line (a run killed mid-write) are cut off, by an atomic rewrite, so the file reads as one
    run with no repeated steps and every later resume reads it.
    """

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        self.dropped = 0  # lines cut off on resume that were not whole rows
        if resume_step is not None and path.exists():
            self._cut_after(resume_step)
        self._file = path.open("a")

    def _cut_after(self, step: int) -> None:
        kept = []
        for line in path_lines(self.path):
            row = _row(line)
            if row is None:
                self.dropped += 1
            elif row["step"] <= step:
                kept.append(line)
        write_atomic(self.path, "".join(ln + "\n" for ln in kept).encode())

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class NoMetrics:
    """A data-parallel run's ranks but the first write no metrics file (rank 0 writes the run's)."""

    dropped = 0

    def write(self, row: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


def path_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_bytes().decode(errors="replace").splitlines() if ln.strip()]


def _row(line: str) -> dict[str, Any] | None:
    """A metrics row, or None for a line that is not one (torn, or edited by hand)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
    return row if ok else None


@dataclass
class Reporter:
    """A progress bar on a terminal; plain lines every ``log_every`` steps otherwise. Output whose reader
    went away (``tiertrain train ... | head``) is noted (``output_closed``): the loop stops there as on
    SIGTERM, with a checkpoint, where a write would otherwise have raised out of the run."""

    total_steps: int
    log_every: int
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    quiet: bool = False

    def __post_init__(self) -> None:
        self.output_closed = False
        self._progress = None
        if not self.quiet and self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=self.total_steps, status="")
            self._progress.start()

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            self._print(text)

    def step(self, row: dict[str, Any]) -> None:
        status = (f"loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                  f"{row['tflops']:.3f} TFLOPS  lr {row['lr']:.2e}")
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], status=status)
        elif not self.quiet and (row["step"] % self.log_every == 0 or row["step"] in (1, self.total_steps)):
            self._print(f"step {row['step']:>6}/{self.total_steps}  {status}  {step_memory(row)}")

    def _print(self, text: str) -> None:
        if self.output_closed:
            return
        try:
            print(text, file=self.stream, flush=True)
        except BrokenPipeError:
            self._output_went_away()

    def _output_went_away(self) -> None:
        """Later writes (and the interpreter's flush as it exits) go to /dev/null instead of raising."""
        self.output_closed = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stream with no file of its own: nothing to redirect
            pass

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def step_memory(row: dict[str, Any]) -> str:
    """A step line's memory: each memory tier's peak, named (on a GPU the device's with the activations
    beside its pool, the figure its budget bounds: one unnamed peak read as the device's there was the
    host's), the disk tier's pages apart (they are no memory), and the process's resident memory."""
    peaks = dict(row["peak_bytes"])
    if "device_with_activations" in peaks:
        peaks["device"] = peaks.pop("device_with_activations")
    memory = " ".join(f"{tier} {format_bytes(peaks[tier])}" for tier in ("device", "host") if tier in peaks)
    rss = row.get("rss_bytes", {}).get("now")
    return (f"peak {memory}" + (f"  disk {format_bytes(peaks['disk'])}" if "disk" in peaks else "")
            + (f"  RSS {format_bytes(rss)}" if rss is not None else ""))


class StepTimer:
    """Wall time of one optimizer step, synchronising CUDA so the figure is real."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start
