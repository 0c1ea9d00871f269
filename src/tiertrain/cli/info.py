"""``tiertrain info``: what a model costs before anything is built."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from tiertrain.errors import ConfigError
from tiertrain.models import resolve_config
from tiertrain.models.accounting import (flops_per_token, param_count, state_bytes,
                                         tier_totals)
from tiertrain.models.config import ModelConfig
from tiertrain.precisions import PRECISIONS
from tiertrain.units import format_bytes, format_count


def model_info(model: str, batch_size: int, seq_len: int | None, precision: str) -> dict[str, Any]:
    cfg = resolve_config(model)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError("info describes tiertrain's own model configs; for a transformers config use tiertrain train")
    seq = seq_len or cfg.max_seq_len
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    sb = state_bytes(cfg, batch_size, seq, precision)
    return {"model": cfg.name or "custom", "config": cfg.to_dict(), "params": param_count(cfg),
            "flops_per_token": flops_per_token(cfg, seq), "batch_size": batch_size, "seq_len": seq,
            "precision": precision, "bytes": sb.as_dict(), "tiers": tier_totals(sb)}


def print_info(info: dict[str, Any], console: Console) -> None:
    c = info["config"]
    console.print(f"[bold]{info['model']}[/]: {format_count(info['params'])} parameters "
                  f"({c['n_layer']} layers, d_model {c['d_model']}, d_ffn {c['d_ffn']}, {c['n_head']} heads"
                  + (f", {c['n_experts']} experts top-{c['top_k']}" if c["n_experts"] else "") + ")")
    console.print(f"training FLOPs per token: {info['flops_per_token']:.3e} at seq_len {info['seq_len']}")
    table = Table(title=f"memory for batch {info['batch_size']} x seq {info['seq_len']}, {info['precision']}, AdamW")
    table.add_column("state kind")
    table.add_column("bytes", justify="right")
    for kind, n in info["bytes"].items():
        table.add_row(kind, format_bytes(n))
    console.print(table)
    tiers = Table(title="total per tier")
    tiers.add_column("placement")
    tiers.add_column("device", justify="right")
    tiers.add_column("host", justify="right")
    for name, t in info["tiers"].items():
        tiers.add_row(name, format_bytes(t["device"]), format_bytes(t["host"]))
    console.print(tiers)


def info_json(info: dict[str, Any]) -> str:
    return json.dumps(info, indent=2)
