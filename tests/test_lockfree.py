import dataclasses

import numpy as np
import pytest

from conftest import read_metrics, tiny_config
from tiered_harness import TINY4, train_plain, train_tiered
from tiertrain.engine.loop import train
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, Tier
from tiertrain.plan import BlockPlan, Plan


def plan(home: Tier, staleness: int) -> Plan:
    return Plan(tuple(BlockPlan(home=home, stream=True) for _ in range(4)), BlockPlan(home=home), window=2,
                prefetch=1, update="lockfree", max_staleness=staleness, name="lockfree")


def budgets(tmp_path) -> Budgets:
    return Budgets(device=8 << 20, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "disk"))


@pytest.mark.parametrize("home", [Tier.HOST, Tier.DISK])
def test_lockfree_with_zero_staleness_is_plain_pytorch_bitwise(tmp_path, home):
    got, _ = train_tiered(TINY4, 12, 1, None, plan(home, 0), budgets(tmp_path))
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
    for st in rt.states[:-1]:
        st.block.module.register_full_backward_pre_hook(lambda m, g, st=st: rt.updater.on_params_written(st))
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
    import tiertrain.optim.updater as updater

    calls = []
    read_ahead = updater.Updater.read_ahead
    monkeypatch.setattr(updater.Updater, "read_ahead", lambda self, st: (calls.append(st.index), read_ahead(self, st)))
    train_tiered(TINY4, 3, 1, None, plan(Tier.DISK, 1), budgets(tmp_path))
    assert calls == []
    train_tiered(TINY4, 3, 1, None, dataclasses.replace(plan(Tier.DISK, 1), update="overlap"), budgets(tmp_path / "o"))
    assert len(calls) >= 3
