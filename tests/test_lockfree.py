import dataclasses

import numpy as np
import pytest

from conftest import made, read_metrics, tiny_config
from tiered_harness import TINY4, train_plain, train_tiered
from tiertrain.train.loop import train
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, Tier
from tiertrain.plan import BlockPlan, Plan


def plan(home: Tier, staleness: int, host_master: bool = False) -> Plan:
    return Plan(tuple(BlockPlan(home=home, stream=True, host_master=host_master) for _ in range(4)),
                BlockPlan(home=home, host_master=host_master), window=2, prefetch=1, update="lockfree",
                max_staleness=staleness, name="lockfree")


def budgets(tmp_path) -> Budgets:
    return Budgets(device=8 << 20, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "disk"))


@pytest.mark.parametrize("home,host_master", [(Tier.HOST, False), (Tier.DISK, False), (Tier.DISK, True)])
def test_lockfree_with_zero_staleness_is_plain_pytorch_bitwise(tmp_path, home, host_master):
    got, _ = train_tiered(TINY4, 12, 1, None, plan(home, 0, host_master), budgets(tmp_path))
    assert got == train_plain(TINY4, 12, 1, None)


def test_lockfree_converges_like_sync_and_reports_the_staleness_it_had(tmp_path):
    common = dict(model="tiny", steps=80, batch_size=8, seq_len=64, lr=1e-2, grad_clip=0.0, plan="stream",
                  device_memory="8MiB", host_memory="64MiB", page_size="64KiB")
    sync = train(tiny_config(tmp_path / "sync", update="sync", **common))
    free = train(tiny_config(tmp_path / "free", update="lockfree", max_staleness=2, **common))
    rows = read_metrics(tmp_path / "free")
    assert all(0 <= r["staleness"] <= 2 for r in rows)
    early, late_sync, late_free = np.mean(sync.losses[:5]), np.mean(sync.losses[-10:]), np.mean(free.losses[-10:])
    assert late_free < early - 1.5  # it learns
    assert abs(late_free - late_sync) < 0.1 * late_sync  # and lands where sync does


def test_lockfree_refuses_clipping_and_accumulation(tmp_path):
    with pytest.raises(ConfigError, match="lockfree updates take gradients as they come"):
        train_tiered(TINY4, 1, 2, None, plan(Tier.HOST, 1), budgets(tmp_path))
    with pytest.raises(ConfigError, match="lockfree updates take gradients as they come"):
        train(tiny_config(tmp_path / "c", plan="stream", update="lockfree", grad_clip=1.0, page_size="64KiB"))
    assert Plan.from_json(plan(Tier.DISK, 3).to_json()) == plan(Tier.DISK, 3)
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        dataclasses.replace(plan(Tier.HOST, 1), max_staleness=-1).validate(4)


def test_a_publish_during_a_blocks_backward_leaves_its_slot_in_place(tmp_path):
    """An update loop may publish a block's params at any moment, also while that block's backward
    runs from its slot (lockfree does this all the time). The publish must not take the slot away
    under the backward: here every block hears of a publish just after its backward acquired it."""
    import tiertrain
    from tiered_harness import _fresh, _loop

    sync = dataclasses.replace(plan(Tier.HOST, 0), update="sync")
    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=sync, page_size=64 * 1024)
    rt = tm.runtime
    for st in rt.groups[:-1]:
        st.block.module.register_full_backward_pre_hook(lambda m, g, st=st: rt.cache.invalidate(st))
    try:
        got = _loop(tm, topt, tm.clip_grad_norm_, 6, 1, None)
    finally:
        rt.close()
        rt.mem.close()
    assert got == train_plain(TINY4, 6, 1, None)


def test_lockfree_leaves_a_blocks_states_to_its_update_loop(tmp_path, monkeypatch):
    """A disk-homed block's states are moved by one party at a time. In lockfree mode its update loop
    may be reading or writing them back whenever backward reaches the block, so backward starts no
    reads of its own there (it did, and under load a loop's write-back and backward's read collided:
    'is moving'); overlap, where updates follow the block's backward, still reads ahead."""
    from tiertrain.runtime.state_moves import StateMoves

    calls = []
    read_ahead = StateMoves.read_ahead
    monkeypatch.setattr(StateMoves, "read_ahead",
                        lambda self, st, *a, **k: (calls.append(st.index), read_ahead(self, st, *a, **k)))
    train_tiered(TINY4, 3, 1, None, plan(Tier.DISK, 1), budgets(tmp_path))
    assert calls == []
    train_tiered(TINY4, 3, 1, None, dataclasses.replace(plan(Tier.DISK, 1), update="overlap"), budgets(made(tmp_path / "o")))
    assert len(calls) >= 3


def _counting_passes(monkeypatch) -> dict[int, int]:
    """Update passes per block index, counted where AdamW runs."""
    import tiertrain.runtime.block_group as updater

    passes: dict[int, int] = {}
    adamw = updater.adamw_block

    def counted(st, *a):
        passes[st.index] = passes.get(st.index, 0) + 1
        return adamw(st, *a)

    monkeypatch.setattr(updater, "adamw_block", counted)
    return passes


@pytest.mark.parametrize("home", [Tier.DISK, Tier.HOST])
def test_disk_homed_lockfree_passes_carry_as_many_steps_as_the_staleness_allows(tmp_path, monkeypatch, home):
    """Each pass over a disk-homed block costs its states' disk traffic, so with max staleness N a pass
    waits for N steps of gradients: about steps / N passes, never staler than N. A host-homed pass is
    cheap, so there loops run as before (fewer passes would only mean fewer updates). At the end
    (close, like a checkpoint) every step's gradients are in the states."""
    import tiertrain
    from tiered_harness import _fresh, _loop

    passes = _counting_passes(monkeypatch)
    steps, staleness = 13, 3  # the last step's gradients are held back until the end
    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan(home, staleness), page_size=64 * 1024)
    rt, seen = tm.runtime, []
    try:
        for _ in range(steps):
            _loop(tm, topt, tm.clip_grad_norm_, 1, 1, None)
            seen.append(rt.pop_staleness())
        rt.wait_updates()
        versions = [st.version for st in rt.groups]
    finally:
        rt.close()
        rt.mem.close()
    assert max(seen) <= staleness
    assert versions == [steps] * len(versions)  # nothing held back is lost
    blocks = [passes.get(i, 0) for i in range(len(versions))]
    if home is Tier.DISK:
        assert max(blocks) <= steps // staleness + 1, blocks
    else:
        assert max(blocks) > steps // staleness + 1, blocks


def test_a_block_staler_than_allowed_gets_its_held_back_gradients_before_use(tmp_path, monkeypatch):
    """Gradients held back to coalesce are applied before a block is used past its staleness, even
    when no loop is due: here the run's step count jumps ahead of what the blocks have seen."""
    import tiertrain
    from tiered_harness import _fresh, _loop

    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan(Tier.DISK, 3), page_size=64 * 1024)
    rt = tm.runtime
    try:
        _loop(tm, topt, tm.clip_grad_norm_, 1, 1, None)  # one step of gradients: a pass is not due yet
        assert all(st.holds_grad_chunk() and st.version == 0 for st in rt.groups)
        rt.clock.steps_taken += 3  # now 4 steps on: one past the staleness allowed
        st = rt.groups[0]
        st.await_params()
        assert st.version == 1 and not st.holds_grad_chunk()
        assert rt.pop_staleness() == 3
    finally:
        rt.close()
        rt.mem.close()


@pytest.mark.parametrize("staleness", [1, 3])
def test_lagging_lockfree_updates_stay_within_the_host_budget_the_plan_was_checked_against(tmp_path, monkeypatch,
                                                                                           staleness):
    """While a block's update loop applies the gradients it took, backward fills a second chunk for
    the block, and the budget check must count both: a run given exactly the bytes it asks for must
    not run out of host memory midway (it did: the check counted one chunk per block). Updates are
    slowed here so that every block's loop lags."""
    import time

    import tiertrain
    import tiertrain.runtime.block_group as updater
    from tiered_harness import _fresh, _loop
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    adamw = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.03), adamw(*a)))
    spec, page = dict(TINY4, d_model=64, d_ffn=128), 4096
    lf = plan(Tier.HOST, staleness)
    model, opt = _fresh(spec)
    need = needs(find_blocks(model, None), lf, page)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=need[Tier.DEVICE], host=need[Tier.HOST]), plan=lf,
                               page_size=page)
    rt = tm.runtime
    try:
        _loop(tm, topt, tm.clip_grad_norm_, 4 * (staleness + 1), 1, None)
        held = rt.mem.stats()["host"]["pages_peak_bytes"]
    finally:
        rt.close()
        rt.mem.close()
    assert held <= need[Tier.HOST]


def test_lockfree_at_zero_staleness_follows_a_learning_rate_schedule_bitwise_even_when_updates_lag(tmp_path,
                                                                                                    monkeypatch):
    """An update loop may start after the training loop has already set the next step's learning
    rate (a schedule moves it every step). The gradients carry the hyperparameters of the step they
    came from, so with max staleness 0 a scheduled run still equals plain PyTorch bit for bit. The
    updates are slowed here so that they start late."""
    import time

    import tiertrain
    import tiertrain.runtime.block_group as updater
    from tiered_harness import _fresh, batches
    from tiertrain.train.objective import lm_loss

    adamw = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.01), adamw(*a)))

    def run(model, opt) -> list[float]:
        losses = []
        for k, b in enumerate(batches(6)):
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (k + 1)
            loss = lm_loss(model, b[:, :-1], b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model, opt = _fresh(TINY4)
    plain = run(model, opt)
    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan(Tier.HOST, 0), page_size=64 * 1024)
    try:
        tiered = run(tm, topt)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert tiered == plain
