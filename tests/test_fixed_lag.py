"""Lockfree at a fixed lag of one step (``Plan.fixed_lag``, ``runtime.modes.fixed_lag``): every step
computes with the params one step old, exactly, so a run is ZeRO-Offload's delayed parameter update and
equals it bit for bit in plain PyTorch, on every tier."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import at_one_thread
from tiered_harness import TINY4, _fresh, batches

import tiertrain
from tiertrain.memory import Budgets, Tier
from tiertrain.models import build
from tiertrain.plan import BlockPlan, Plan
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw

STEPS = 6


def _plan(home: Tier, stream: bool = True, host_master: bool = False, compute: str = "fp32") -> Plan:
    blocks = tuple(BlockPlan(home=home, stream=stream, host_master=host_master) for _ in range(TINY4["n_layer"]))
    return Plan(blocks, BlockPlan(home=home, host_master=host_master), window=2, prefetch=1, update="lockfree",
                max_staleness=1, fixed_lag=True, compute_dtype=compute, name="fixed-lag")


@at_one_thread
def delayed_plain(steps: int) -> tuple[list[float], float]:
    """Plain PyTorch with a delayed parameter update: AdamW steps a copy of the model (the master), and
    after each backward the model takes the master's values from before that step's update, so step s
    computes with the updates of steps before s - 1. Also the master's loss on one more batch, after the
    last update."""
    torch.manual_seed(0)
    model = build(TINY4)
    master = copy.deepcopy(model)
    opt, _ = make_adamw(master, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    losses, data = [], batches(steps + 1)
    for b in data[:steps]:
        loss = lm_loss(model, b[:, :-1], b[:, 1:])
        loss.backward()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                m.grad, p.grad = p.grad, None
                p.copy_(m)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        return losses, lm_loss(master, data[-1][:, :-1], data[-1][:, 1:]).item()


@at_one_thread
def fixed_lag_run(plan: Plan, tmp_path, steps: int = STEPS) -> tuple[list[float], list[int], float]:
    """The losses, the staleness each step reported, and the loss on one more batch after ``wait_updates``
    (which brings the params up to the master)."""
    model, opt = _fresh(TINY4)
    budgets = Budgets(device=8 << 20, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "disk"))
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, page_size=64 << 10)
    losses, stale, data = [], [], batches(steps + 1)
    try:
        for b in data[:steps]:
            loss = lm_loss(tm, b[:, :-1], b[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
            stale.append(tm.runtime.mode.pop_staleness())
        tm.runtime.wait_updates()
        with torch.no_grad():
            after = lm_loss(tm, data[-1][:, :-1], data[-1][:, 1:]).item()
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    return losses, stale, after


@pytest.mark.parametrize("home,stream,host_master", [(Tier.HOST, True, False), (Tier.DISK, True, False),
                                                     (Tier.DISK, True, True), (Tier.HOST, False, False),
                                                     (Tier.DEVICE, False, False), (Tier.DISK, False, False)])
def test_a_fixed_lag_is_the_delayed_parameter_update_bit_for_bit(tmp_path, home, stream, host_master):
    """Streamed or resident, states on the host, the device or disk: the same losses as plain PyTorch
    delaying each update by a step, a staleness of exactly one from the second step on, and the params
    caught up with every update once the run waits for them."""
    got, stale, after = fixed_lag_run(_plan(home, stream, host_master), tmp_path)
    want, caught_up = delayed_plain(STEPS)
    assert got == want
    assert stale == [0] + [1] * (STEPS - 1)
    assert after == caught_up


def test_a_slow_update_holds_the_next_step_back_not_its_params(tmp_path, monkeypatch):
    """An update slower than a step (the last block's AdamW held back 0.2 s, the first in backward's order,
    whose job has the update workers to itself): the block's next job waits for it, so none publishes a
    master another still writes, and the lag stays exactly one step."""
    import time

    from tiertrain.runtime import block_group

    adamw = block_group.adamw_block

    def slow(group, *args, **kwargs):
        if group.index == TINY4["n_layer"] - 1:
            time.sleep(0.2)
        adamw(group, *args, **kwargs)
    monkeypatch.setattr(block_group, "adamw_block", slow)
    got, stale, after = fixed_lag_run(_plan(Tier.HOST), tmp_path, steps=4)
    want, caught_up = delayed_plain(4)
    assert (got, stale, after) == (want, [0, 1, 1, 1], caught_up)


def test_a_fixed_lag_it_cannot_keep_is_refused_naming_the_fix(tmp_path):
    """A fixed lag is lockfree's at max staleness 1, of blocks whose master an update holds whole; a plan file
    keeps it; plan auto does not plan it yet."""
    import dataclasses

    from tiertrain.errors import ConfigError

    lagged = _plan(Tier.DISK)
    assert Plan.from_json(lagged.to_json()) == lagged and '"fixed_lag": true' in lagged.to_json()
    assert "fixed_lag" not in dataclasses.replace(lagged, fixed_lag=False).to_json()
    for change, says in (({"update": "overlap"}, ("this plan has update 'overlap' at max staleness 1: use update "
                                                  "'lockfree' with max_staleness 1")),
                         ({"max_staleness": 2}, "'lockfree' at max staleness 2"),
                         ({"blocks": tuple(dataclasses.replace(b, piece=1 << 20) for b in lagged.blocks)},
                          "a block updated in pieces never holds: set piece to 0")):
        with pytest.raises(ConfigError, match=says):
            dataclasses.replace(lagged, **change).validate(TINY4["n_layer"])
    model, opt = _fresh(TINY4)
    with pytest.raises(ConfigError, match="plan 'auto' does not plan a fixed lag"):
        tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan="auto", update="lockfree", fixed_lag=True)
    with pytest.raises(ConfigError, match="at max staleness 0: use update 'lockfree' with max_staleness 1"):
        tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan="stream", update="lockfree", max_staleness=0,
                        fixed_lag=True)
