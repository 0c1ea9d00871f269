"""``tiertrain probe``: this machine's description, measured, and the built-in ones."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tiertrain.plan.fit import capacity_params
from tiertrain.planner.machine import Machine
from tiertrain.units import format_bytes, format_count


def take_probe(disk_dir: str | None) -> Machine:
    """A fresh measurement (a cached one may be stale: this is how to renew it); kept when quiet. With
    the disk's gain for reads and writes at once, which ``tiertrain plan`` plans with."""
    from tiertrain.measure.machine import probe, with_disk_gain

    return with_disk_gain(probe(disk_dir, use_cache=False), disk_dir)


def _rates(m: Machine) -> list[tuple[str, str]]:
    flops = lambda r: ", ".join(f"{d} {getattr(r, d) / 1e12:.2f}" for d in ("fp32", "bf16", "fp16"))  # noqa: E731
    rows = [("device", f"{m.device}, {format_bytes(m.device_memory)}"), ("host", format_bytes(m.host_memory)),
            ("disk", f"{format_bytes(m.disk_bytes)}, read {m.disk_read_bps / 1e9:.2f} GB/s, "
                     f"write {m.disk_write_bps / 1e9:.2f} GB/s, both at once x{m.disk_together_gain:.2f} "
                     "their speed in turns"),
            ("matmul TFLOP/s achieved", flops(m.matmul_flops))]
    if any((m.peak_flops.fp32, m.peak_flops.bf16, m.peak_flops.fp16)):
        rows.append(("peak TFLOP/s (dense)", flops(m.peak_flops)))
    rows += [("memory", f"{m.memory_bps / 1e9:.1f} GB/s"),
             ("copies", f"in {m.h2d_bps / 1e9:.1f} GB/s, out {m.d2h_bps / 1e9:.1f} GB/s"),
             ("CPU AdamW", f"{m.adam_params_per_s / 1e9:.2f} G params/s"),
             ("page size", format_bytes(m.page_size) if m.page_size else "measured per run")]
    if m.load is not None:
        rows.append(("load while probed", f"others used {m.load.others_cores:.2f} of {m.load.cores} cores"
                                          f"{' (busy: not cached)' if m.load.busy else ''}"))
    return rows


def print_machine(m: Machine, console: Console) -> None:
    table = Table(title=m.name, show_header=False)
    table.add_column("")
    table.add_column("")
    for key, value in _rates(m):
        table.add_row(key, value)
    console.print(table)


def print_builtins(console: Console) -> None:
    from tiertrain.planner.datasheets import BUILTIN

    table = Table(title="built-in machines (plan --machine NAME)")
    for col in ("name", "device", "host", "disk", "bf16 matmul", "capacity bound"):
        table.add_column(col)
    for m in BUILTIN.values():
        sizes = m.budgets()
        table.add_row(m.name, format_bytes(m.device_memory), format_bytes(m.host_memory), format_bytes(m.disk_bytes),
                      f"{m.matmul_flops.bf16 / 1e12:.0f} TFLOP/s" if m.matmul_flops.bf16 else "-",
                      f"{format_count(capacity_params(sizes))} params")
    console.print(table)
    console.print("capacity bound: (device + host + disk budgets) / 16 B per parameter; budgets are 90% of device "
                  "memory and RAM, the whole disk")
    for m in BUILTIN.values():
        console.print(f"  {m.name}: {m.source}")
