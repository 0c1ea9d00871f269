"""A new plan takes effect at a step boundary (issue 18: plan auto's first step is the profile): states
move between tiers byte for byte, so the losses stay plain PyTorch's bit for bit, and every tier
stays within its budget while they move."""

import dataclasses

import pytest

from tiered_harness import TINY4, _fresh, batches, train_plain
from tiertrain.train.objective import lm_loss
from tiertrain.memory import Budgets, Tier
from tiertrain.plan import BlockPlan, Plan, builtin_plan

import tiertrain
from tiertrain.plan.bytes import state_homes
from tiertrain.plan.fit import PlanDoesNotFit, resolve
from tiertrain.runtime.replan import replan

PAGE = 64 << 10


def _plans(n: int) -> dict[str, Plan]:
    mixed = Plan(tuple(BlockPlan(home=(Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.HOST)[i % 4], stream=i % 2 == 1,
                                 recompute=i == 2, offload_hidden=i == 3) for i in range(n)),
                 BlockPlan(home=Tier.DISK, host_master=True), window=1, prefetch=0, name="mixed")
    return {"resident": builtin_plan("resident", n), "stream": builtin_plan("stream", n),
            "max-offload": builtin_plan("max-offload", n, disk=True), "mixed": mixed}


def _resolved(tm, plan, budgets):
    """``plan`` resolved for the run ``tm`` is (``plan.fit.resolve``), as plan auto's first step resolves its choice."""
    return resolve(plan, tm.runtime.sizes, budgets, PAGE, needs_all_grads=False)


@pytest.fixture
def whole_device_pool(monkeypatch):
    """A run replans only after plan auto's first step, and its device pool keeps the whole budget;
    these runs are set up with a given plan to replan from, so their pools are made as auto's are."""
    monkeypatch.setattr("tiertrain.api.setup._device_reserve", lambda plan, first: None)


@pytest.mark.usefixtures("whole_device_pool")
@pytest.mark.parametrize("update", ["sync", "overlap"])
@pytest.mark.parametrize("first, then", [("max-offload", "resident"), ("resident", "max-offload"),
                                         ("stream", "mixed"), ("mixed", "stream"), ("max-offload", "mixed")])
def test_a_new_plan_at_a_step_boundary_keeps_plain_pytorchs_losses(tmp_path, first, then, update):
    plans = _plans(4)
    budgets = Budgets(32 << 20, 32 << 20, 64 << 20, str(tmp_path / "disk"))
    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets, plan=dataclasses.replace(plans[first], update=update),
                               page_size=PAGE)
    losses = []
    try:
        for k, b in enumerate(batches(6)):
            if k == 3:
                replan(tm.runtime, _resolved(tm, dataclasses.replace(plans[then], update=update), budgets))
                homes = [c.tier for g in tm.runtime.groups for c in g.states]
                assert homes == [t for bp in (*plans[then].blocks, plans[then].rest) for t in state_homes(bp)]
            loss = lm_loss(tm, b[:, :-1], b[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
        stats = tm.runtime.mem.stats()
        assert tm.runtime.plan.name == plans[then].name
        assert all(stats[t]["pages_peak_bytes"] <= stats[t]["budget"] for t in ("device", "host", "disk"))
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert losses == train_plain(TINY4, 6, 1, None)


def test_a_run_whose_device_pool_holds_its_own_plan_refuses_a_plan_that_needs_more_device(tmp_path):
    plans = _plans(4)
    model, opt = _fresh(TINY4)
    budgets = Budgets(32 << 20, 32 << 20, 64 << 20, str(tmp_path / "disk"))
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plans["max-offload"], page_size=PAGE)
    try:
        with pytest.raises(PlanDoesNotFit, match="plan 'resident' needs .* device .* planned from its own first step"):
            replan(tm.runtime, _resolved(tm, plans["resident"], budgets))
        assert tm.runtime.plan.name == plans["max-offload"].name  # refused before anything moved
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
