"""Per-step figures: the JSONL metrics file, and what the user sees while training runs."""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from tiertrain.units import format_bytes


def peak_bytes(device: torch.device) -> dict[str, int]:
    """Peak bytes per tier so far: the CUDA allocator's peak, and the process's peak RSS."""
    peaks = {"host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peaks["device"] = torch.cuda.max_memory_allocated(device)
    return peaks


def device_peak_with_activations(pages_peak: int, pool_bytes: int, device: torch.device) -> int | None:
    """With CUDA: the device pool's page peak plus the most torch allocated beside the pool
    (activations, gradients before they leave): the figure the planner's device peak predicts there.
    None elsewhere: on CPU the planner leaves activations out, and the page peak is the figure."""
    if device.type != "cuda":
        return None
    return pages_peak + max(0, torch.cuda.max_memory_allocated(device) - pool_bytes)


class MetricsFile:
    """``OUT/metrics.jsonl``: one JSON object per optimizer step.

    On resume, rows past the resumed step are dropped first, so the file always reads as
    one run with no repeated steps.
    """

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            path.write_text("")
        self._file = path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class Reporter:
    """A progress bar on a terminal; plain lines every ``log_every`` steps otherwise."""

    total_steps: int
    log_every: int
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    quiet: bool = False

    def __post_init__(self) -> None:
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
            print(text, file=self.stream, flush=True)

    def step(self, row: dict[str, Any]) -> None:
        status = (f"loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                  f"{row['tflops']:.3f} TFLOPS  lr {row['lr']:.2e}")
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], status=status)
        elif not self.quiet and (row["step"] % self.log_every == 0 or row["step"] in (1, self.total_steps)):
            peak = max(row["peak_bytes"].values())
            print(f"step {row['step']:>6}/{self.total_steps}  {status}  peak {format_bytes(peak)}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


class StepTimer:
    """Wall time of one optimizer step, synchronising CUDA so the figure is real."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start
