"""Lockfree at a fixed lag of one step (``Plan.fixed_lag``, ``runtime.modes.fixed_lag``): every step
computes with the params one step old, exactly, so a run is ZeRO-Offload's delayed parameter update and
equals it bit for bit in plain PyTorch, on every tier."""

from __future__ import annotations

import pytest
import torch
from conftest import at_one_thread
from delayed_update import DelayedAdamW
from tiered_harness import TINY4, _fresh, batches

import tiertrain
from tiertrain.memory import Budgets, Tier
from tiertrain.models import build
from tiertrain.plan import BlockPlan, Plan
from tiertrain.train.objective import lm_loss
from tiertrain.train.optimizer import make_adamw

STEPS = 6


def _plan(home: Tier, stream: bool = True, host_master: bool = False) -> Plan:
    blocks = tuple(BlockPlan(home=home, stream=stream, host_master=host_master) for _ in range(TINY4["n_layer"]))
    return Plan(blocks, BlockPlan(home=home, host_master=host_master), window=2, prefetch=1, update="lockfree",
                max_staleness=1, fixed_lag=True, name="fixed-lag")


@at_one_thread
def delayed_plain(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch with a delayed parameter update (``DelayedAdamW``): the losses, and the master after
    the last update."""
    torch.manual_seed(0)
    opt = DelayedAdamW(build(TINY4))
    losses = []
    for b in batches(steps):
        loss = lm_loss(opt.model, b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt.master.state_dict()


@at_one_thread
def fixed_lag_run(plan: Plan, tmp_path, steps: int = STEPS,
                  read_at: int | None = None) -> tuple[list[float], list[int], dict[str, torch.Tensor]]:
    """The losses, the staleness each step reported, and the state dict after the last step (the master's).
    ``read_at``: the state dict read after that step too, as a loop that logs or saves it does."""
    model, opt = _fresh(TINY4)
    budgets = Budgets(device=8 << 20, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "disk"))
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, page_size=64 << 10)
    losses, stale = [], []
    try:
        for step, b in enumerate(batches(steps)):
            loss = lm_loss(tm, b[:, :-1], b[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
            stale.append(tm.runtime.mode.pop_staleness())
            if step == read_at:
                tm.state_dict()
        return losses, stale, tm.state_dict()
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


@pytest.mark.parametrize("home,stream,host_master", [(Tier.HOST, True, False), (Tier.DISK, True, False),
                                                     (Tier.DISK, True, True), (Tier.HOST, False, False),
                                                     (Tier.DEVICE, False, False), (Tier.DISK, False, False)])
def test_a_fixed_lag_is_the_delayed_parameter_update_bit_for_bit(tmp_path, home, stream, host_master):
    """Streamed or resident, states on the host, the device or disk: the same losses as plain PyTorch
    delaying each update by a step, a staleness of exactly one from the second step on, and the master
    plain PyTorch's. A state dict read part way (it waits for the updates in flight) changes nothing."""
    got, stale, after = fixed_lag_run(_plan(home, stream, host_master), tmp_path, read_at=2)
    want, master = delayed_plain(STEPS)
    assert got == want
    assert stale == [0] + [1] * (STEPS - 1)
    assert after.keys() == master.keys() and all(torch.equal(after[k], master[k]) for k in master)


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
    got, stale, _ = fixed_lag_run(_plan(Tier.HOST), tmp_path, steps=4)
    assert (got, stale) == (delayed_plain(4)[0], [0, 1, 1, 1])


def test_a_fixed_lag_it_cannot_keep_is_refused_naming_the_fix(tmp_path):
    """A fixed lag is lockfree's at max staleness 1 (inert at 0 and in the other modes), of blocks whose
    master an update holds whole: never cut into pieces, also where the host would want them; a plan file
    keeps it; overrides are checked together; plan auto does not plan it yet."""
    import dataclasses

    from tiertrain.errors import ConfigError
    from tiertrain.plan.fit import pieces_to_fit
    from tiertrain.runtime.blocks import block_sizes, find_blocks

    lagged = _plan(Tier.DISK)
    assert Plan.from_json(lagged.to_json()) == lagged and '"fixed_lag": true' in lagged.to_json()
    assert "fixed_lag" not in dataclasses.replace(lagged, fixed_lag=False).to_json()
    for inert in ({"update": "overlap"}, {"max_staleness": 0}):
        dataclasses.replace(lagged, **inert).validate(TINY4["n_layer"])
    for change, says in (({"max_staleness": 2}, "lets them lag 2: set max_staleness 1, or fixed_lag to false"),
                         ({"blocks": tuple(dataclasses.replace(b, piece=1 << 20) for b in lagged.blocks)},
                          "a block updated in pieces never holds: set piece to 0")):
        with pytest.raises(ConfigError, match=says):
            dataclasses.replace(lagged, **change).validate(TINY4["n_layer"])
    wide = block_sizes(find_blocks(build(dict(TINY4, d_model=256, d_ffn=1024), device="meta")))
    tight = Budgets(64 << 20, 32 << 20, 1 << 30)
    free = dataclasses.replace(lagged, fixed_lag=False)
    assert all(b.piece for b in pieces_to_fit(wide, free, 64 << 10, tight).blocks)  # the host wants pieces
    assert pieces_to_fit(wide, lagged, 64 << 10, tight) == lagged  # the budget check then names what it needs
    model, opt = _fresh(TINY4)
    with pytest.raises(ConfigError, match="plan 'auto' does not plan a fixed lag"):
        tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan="auto", update="lockfree", fixed_lag=True)
    path = tmp_path / "lagged.json"
    path.write_text(dataclasses.replace(lagged, rest=BlockPlan(home=Tier.HOST),
                                        blocks=tuple(BlockPlan(home=Tier.HOST, stream=True) for _ in lagged.blocks),
                                        max_staleness=2, fixed_lag=False).to_json())
    tm, _ = tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan=str(path), max_staleness=1, fixed_lag=True,
                            page_size=64 << 10)  # checked once both are in
    try:
        assert type(tm.runtime.mode).__name__ == "FixedLagMode"
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_an_update_that_fails_before_publishing_raises_at_the_blocks_next_forward(tmp_path, monkeypatch):
    """The block's next forward waits for the publish: one that raised raises there, naming its error, not
    later (and the forward never runs on params a step older than it should)."""
    from tiertrain.runtime.block_group import BlockGroup

    publish, calls = BlockGroup.publish_and_take, []

    def failing(self):
        calls.append(self.index)
        if calls.count(1) == 2:  # the second step's publish of block 1
            raise RuntimeError("publish failed")
        return publish(self)
    monkeypatch.setattr(BlockGroup, "publish_and_take", failing)
    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan=_plan(Tier.HOST), page_size=64 << 10)
    forwards = []
    tm.blocks[1].register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        data = batches(3)
        for b in data[:2]:
            lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
            topt.step()
            topt.zero_grad()
        with pytest.raises(RuntimeError, match="publish failed"):
            lm_loss(tm, data[2][:, :-1], data[2][:, 1:])
        assert len(forwards) == 2  # block 1's third forward never ran
        with pytest.raises(RuntimeError, match="publish failed"):  # and again at close, which still stops all
            tm.runtime.close()
        assert tm.runtime.mode.pool._shutdown
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


class _Skipping(torch.nn.Module):
    """Three blocks, the middle one left out of the forward while ``skip`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 256)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                h = h + torch.tanh(block(h))
        return self.head(h)


def _skipping_losses(model: torch.nn.Module, opt, steps: int) -> list[float]:
    losses = []
    for step, b in enumerate(batches(steps)):
        for m in model.modules():
            if isinstance(m, _Skipping):
                m.skip = step % 2 == 1
        loss = torch.nn.functional.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stream", [False, True])
@at_one_thread
def test_a_block_without_gradients_in_a_step_still_publishes_and_lags_one_step(tmp_path, stream):
    """A block the forward skips every other step gets no gradient there: the step publishes what its master
    holds anyway, so it reads params one step old, as plain PyTorch's delayed update copies every parameter
    every step."""
    torch.manual_seed(0)
    plain = _Skipping()
    want = _skipping_losses(plain, DelayedAdamW(plain), 6)
    torch.manual_seed(0)
    model = _Skipping()
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    blocks = tuple(BlockPlan(home=Tier.HOST, stream=stream) for _ in range(3))
    plan = Plan(blocks, BlockPlan(home=Tier.HOST), window=3, prefetch=0, update="lockfree", max_staleness=1,
                fixed_lag=True)
    tm, topt = tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan=plan, page_size=64 << 10,
                               blocks="blocks")
    try:
        assert _skipping_losses(tm, topt, 6) == want
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
