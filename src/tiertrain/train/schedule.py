"""Linear warm-up then cosine decay, as a pure function of the step (so resume needs only the step)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tiertrain.train.config import TrainConfig

SCHEDULE_OPTIONS = ("steps", "lr", "min_lr", "warmup_steps")  # what the lr at a step depends on


def lr_at(step: int, peak: float, floor: float, warmup: int, total: int) -> float:
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def schedule_moved(saved: dict[str, Any], cfg: TrainConfig, step: int) -> str | None:
    """What resuming with other schedule options than the run began with (most often a larger
    --steps, to train on) does to the learning rate: the schedule is a function of them, so the
    next step's lr jumps; said once as the run resumes. None where the lr stays where it was."""
    before = {k: saved[k] for k in SCHEDULE_OPTIONS if k in saved}
    old = dataclasses.replace(cfg, **before)
    was = lr_at(step, old.lr, old.final_lr, old.warmup, old.steps)
    now = lr_at(step, cfg.lr, cfg.final_lr, cfg.warmup, cfg.steps)
    if math.isclose(was, now, rel_tol=1e-9):
        return None
    changed = [k for k in before if before[k] != getattr(cfg, k)]
    flags = ", ".join(f"--{k.replace('_', '-')} {before[k]} -> {getattr(cfg, k)}" for k in changed)
    if step >= old.steps:  # the run's schedule ended: its own --steps would leave nothing to do
        keep = f"--lr {was:.6g} --min-lr {was:.6g} --warmup-steps 0"
        how = f"; resume with {keep} to go on at the lr it ended with"
    else:
        keep = " ".join(f"--{k.replace('_', '-')} {before[k]}" for k in changed if before[k] is not None)
        how = f"; resume with {keep} to keep it" if keep else ""
    return (f"the learning-rate schedule moved ({flags}): step {step + 1} runs at lr {now:.3g} where the run's own "
            f"schedule had {was:.3g}" + how)


def batch_moved(saved: dict[str, Any], saved_world: int, cfg: TrainConfig, world: int) -> str | None:
    """What resuming with another world size, accumulation, batch or sequence length than the checkpoint's
    run does: each step takes another number of tokens, so the losses part from the uninterrupted run's.
    Said once as the run resumes; None where a step takes what it took."""
    def tokens(c: dict[str, Any], ranks: int) -> int:
        return c["batch_size"] * c["seq_len"] * c["grad_accum"] * ranks
    keys = ("batch_size", "seq_len", "grad_accum")
    if any(saved.get(k) is None for k in keys):
        return None
    now = {k: getattr(cfg, k) for k in keys}
    saved_pp, saved_tp = (saved.get(k) if isinstance(saved.get(k), int) and saved.get(k, 0) > 0 else 1
                          for k in ("pp", "tp"))
    # the replicas read batches: a pipeline's pp ranks read one replica's, a tensor-parallel group's tp ranks too
    was, now_replicas = saved_world // (saved_pp * saved_tp), world // (cfg.pp * cfg.tp)
    before, after = tokens(saved, was), tokens(now, now_replicas)
    if before == after and was == now_replicas and all(saved[k] == now[k] for k in keys):
        return None
    unit = "ranks" if saved_pp * saved_tp == cfg.pp * cfg.tp == 1 else "data-parallel replicas"
    changed = ([f"{was} {unit} -> {now_replicas}"] if was != now_replicas else []) + [
        f"--{k.replace('_', '-')} {saved[k]} -> {now[k]}" for k in keys if saved[k] != now[k]]
    layout = (f" --pp {saved_pp}" if saved_pp > 1 else "") + (f" --tp {saved_tp}" if saved_tp > 1 else "")
    keep = " ".join(([f"--nproc {saved_world}{layout}"] if was != now_replicas else [])
                    + [f"--{k.replace('_', '-')} {saved[k]}" for k in keys if saved[k] != now[k]])
    return (f"this run takes {after:,} tokens a step where the checkpoint's took {before:,} ({', '.join(changed)}): "
            f"its losses part from the uninterrupted run's; resume with {keep} to keep them")
