"""The summary printed when a run ends."""

from __future__ import annotations

from rich.console import Console

from tiertrain.train.loop import RunSummary
from tiertrain.units import format_bytes


def print_summary(s: RunSummary, console: Console) -> None:
    state = "stopped early" if s.stopped_early else "done"
    ran = len(s.losses)  # this process's steps: a resumed run started past step 0
    span = f" (steps {s.steps - ran} -> {s.steps})" if ran != s.steps else ""
    console.print(f"[bold]{state}[/]: {ran} steps{span} in {s.seconds:.1f} s")
    console.print(f"  loss            {s.first_loss:.4f} -> {s.last_loss:.4f}" if s.losses else "  loss            (no steps run)")
    console.print(f"  throughput      {s.tokens_per_s:,.0f} tokens/s, {s.tflops:.3f} TFLOPS (median step)")
    if s.cpu_cores is not None:
        console.print(f"  CPU busy        {s.cpu_cores:.1f} of {s.cores} cores (median of a step, {s.cpu_kernel:.0%} of it in "
                      f"the kernel; near {s.cores}: the cores are the limit, well below: the step waits)")
        if s.cpu_phases:
            console.print("                  " + ", ".join(f"{p} {busy:.1f}" for p, busy in s.cpu_phases.items()))
    if s.disk_busy is not None:
        console.print(f"  disk busy       {s.disk_busy:.0%} of a step (median; near 100%: the disk is the limit)")
        if s.disk_busy_phases:
            console.print("                  " + ", ".join(f"{p} {busy:.0%}" for p, busy in s.disk_busy_phases.items())
                          + " (idle in a phase: room to read ahead there)")
    if s.rss_peak is not None:
        beside = f"; budgets in host memory {format_bytes(s.budgets)}" if s.budgets else ""
        console.print(f"  memory          RSS peak {format_bytes(s.rss_peak)} in steps, {format_bytes(s.setup_rss)} "
                      f"in setup{beside}")
    console.print(f"  metrics         {s.out / 'metrics.jsonl'}")
    if s.checkpoint:
        console.print(f"  checkpoint      {s.checkpoint}")
        console.print(f"  resume with     tiertrain train --resume {s.out}" + (" --steps N" if not s.stopped_early else ""))
