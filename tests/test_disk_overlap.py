"""The disk keeps working through the whole step: states written back while the next forward
runs, states read in during forward, as many read ahead as the host budget holds. Each is
checked structurally (what is in flight or where at a given point), never by timing, and the
losses stay plain PyTorch's."""

import dataclasses
import threading

import pytest

import tiertrain
from tiered_harness import TINY4, _fresh, _loop, batches, train_plain
from tiertrain.train.objective import lm_loss
from tiertrain.memory import Budgets, Kind, Tier
from tiertrain.memory.movement import Handle
from tiertrain.plan import BlockPlan, Plan
from tiertrain.runtime.block_group import BlockGroup
from tiertrain.runtime.blocks import find_blocks
from conftest import needs
from tiertrain.plan.fit import widest_read_ahead
from tiertrain.runtime.blocks import block_sizes

PAGE = 64 * 1024


def disk_plan(update: str, stream: bool, param_copy: bool = True, workers: int = 2, read_ahead: int = 2,
              n: int = 4) -> Plan:
    block = BlockPlan(home=Tier.DISK, stream=stream, param_copy=stream and param_copy)
    return Plan((block,) * n, BlockPlan(home=Tier.DISK), window=2, prefetch=1, update=update,
                update_workers=workers, read_ahead=read_ahead)


def budgets(tmp_path, host: int = 64 << 20) -> Budgets:
    return Budgets(device=8 << 20, host=host, disk=64 << 20, disk_dir=str(tmp_path / "disk"))


def _setup(tmp_path, plan: Plan, host: int = 64 << 20, max_grad_norm: float | None = None, spec: dict = TINY4):
    model, opt = _fresh(spec)
    return tiertrain.setup(model, opt, budgets(tmp_path, host), plan=plan, page_size=PAGE, max_grad_norm=max_grad_norm)


def _close(tm) -> None:
    tm.runtime.close()
    tm.runtime.mem.close()


def _step(tm, topt, batch, losses: list[float], clip: bool = False) -> None:
    loss = lm_loss(tm, batch[:, :-1], batch[:, 1:])
    loss.backward()
    if clip:
        tm.clip_grad_norm_(1.0)
    topt.step()
    topt.zero_grad()
    losses.append(loss.item())


def _held_rest_write_back(rt, gate: threading.Event, timed_out: threading.Event):
    """``rt.mem.move`` with the rest's write-backs held until ``gate`` opens (by itself after 30 s, setting
    ``timed_out``, so a runtime that waits for them fails instead of hanging)."""
    rest = rt.groups[-1]
    move = rt.mem.move

    def held_move(chunk, tier, contiguous=False):
        if tier is not Tier.DISK or not any(chunk is c for c in (rest.master, rest.exp_avg, rest.exp_avg_sq)):
            return move(chunk, tier, contiguous)
        proxy = Handle()

        def later():
            if not gate.wait(30):
                timed_out.set()
            try:
                move(chunk, tier, contiguous).wait()
                proxy._finish(None)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits, as a real move does
                proxy._finish(e)

        threading.Thread(target=later, daemon=True).start()
        return proxy
    return held_move


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_forward_runs_while_the_states_are_still_written_back(tmp_path, stream):
    """Overlap: a block whose params were published to its device slot or host param home needs
    nothing from its write-back, so the next forward must not wait for it. The write-back of the
    rest (embeddings and head: updated last, used first) is held at a gate until the forward has
    run; the gate opens by itself after 30 s, so a runtime that waits fails instead of hanging."""
    gate, timed_out = threading.Event(), threading.Event()
    want = train_plain(TINY4, 3, 1, None)
    tm, topt = _setup(tmp_path, disk_plan("overlap", stream))
    rt = tm.runtime
    held_move = _held_rest_write_back(rt, gate, timed_out)

    losses: list[float] = []
    data = batches(3)
    try:
        _step(tm, topt, data[0], losses)
        rt.wait_updates()  # the first step's write-backs land before any is held
        rt.mem.move = held_move
        _step(tm, topt, data[1], losses)
        batch = data[2]
        loss = lm_loss(tm, batch[:, :-1], batch[:, 1:])  # returns only once every block's update is done
        assert not gate.is_set() and not timed_out.is_set(), "the forward waited for a write-back"
        gate.set()
        loss.backward()
        topt.step()
        topt.zero_grad()
        losses.append(loss.item())
    finally:
        gate.set()
        _close(tm)
    assert losses == want


def _in_host(tm, kind: Kind = Kind.MASTER) -> int:
    return tm.runtime.mem.accounting.chunks(Tier.HOST, kind)


def _settle_writes(tm) -> None:
    """Wait for the last step's updates and write-backs (the forward-time trigger never waits)."""
    for g in tm.runtime.groups:
        g.wait_update()
    tm.runtime.moves.drain()


@pytest.mark.parametrize("update,workers", [("sync", 1), ("overlap", 1), ("overlap", 2), ("overlap-clipped", 1)])
@pytest.mark.parametrize("stream,param_copy", [(False, False), (True, True), (True, False)])
def test_forward_reads_in_the_states_backward_updates_first(tmp_path, update, workers, stream, param_copy):
    """Once every state is home on disk, the next forward starts reading in those of the blocks backward
    reaches first: ``read_ahead`` of them, and where updates follow backward (overlap, not clipped), with
    no update or write-back running, as many more as the update workers' places (two each) hold: updates
    take blocks in that order, so the host never holds more than the budget counts. Where a block's slot
    is filled from its fp32 master itself (max-offload's layout) that master stays put for the copy into
    the slot, and only its moments are read; it comes from the slot as its backward begins."""
    mode, clip = update.split("-")[0], update.endswith("clipped")
    spec = {**TINY4, "n_layer": 8}  # more blocks than every place holds
    plan = disk_plan(mode, stream, param_copy, workers=workers, read_ahead=1, n=8)
    blocks = find_blocks(_fresh(spec)[0])
    host = needs(blocks, plan, PAGE)[Tier.HOST]  # exactly this plan: no wider read-ahead fits
    want = train_plain(spec, 4, 1, 1.0 if clip else None)
    tm, topt = _setup(tmp_path, plan, host, max_grad_norm=1.0 if clip else None, spec=spec)
    losses: list[float] = []
    data = batches(4)
    ahead = 1 if mode == "sync" or clip else 1 + 2 * workers
    fills_slot = stream and not param_copy
    try:
        assert tm.runtime.plan.read_ahead == 1
        _step(tm, topt, data[0], losses, clip)
        for batch in data[1:]:  # every step, not only the first after the warm-up
            _settle_writes(tm)
            assert _in_host(tm) == _in_host(tm, Kind.EXP_AVG) == 0
            loss = lm_loss(tm, batch[:, :-1], batch[:, 1:])
            assert (_in_host(tm), _in_host(tm, Kind.EXP_AVG)) == (0 if fills_slot else ahead, ahead)
            loss.backward()
            if clip:
                tm.clip_grad_norm_(1.0)
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
        assert tm.runtime.mem.stats()["host"]["pages_peak_bytes"] <= host
    finally:
        _close(tm)
    assert losses == want


def test_forward_leaves_the_workers_places_while_a_write_back_is_still_in_flight(tmp_path):
    """The update workers' places are free for forward's reads only once every write-back has landed:
    with the rest's write-back held, forward reads the one read-ahead block and no more."""
    gate, timed_out = threading.Event(), threading.Event()
    plan = disk_plan("overlap", stream=False, workers=1, read_ahead=1)
    tm, topt = _setup(tmp_path, plan, needs(find_blocks(_fresh(TINY4)[0]), plan, PAGE)[Tier.HOST])
    rt = tm.runtime
    data, losses = batches(3), []
    try:
        _step(tm, topt, data[0], losses)
        rt.wait_updates()
        rt.mem.move = _held_rest_write_back(rt, gate, timed_out)
        _step(tm, topt, data[1], losses)
        lm_loss(tm, data[2][:, :-1], data[2][:, 1:])
        assert not timed_out.is_set() and sorted(rt.moves._reads) == [len(rt.groups) - 2]
        gate.set()
        rt.wait_updates()
        lm_loss(tm, data[2][:, :-1], data[2][:, 1:])  # nothing in flight now: the workers' places too
        assert sorted(rt.moves._reads) == [len(rt.groups) - 4, len(rt.groups) - 3, len(rt.groups) - 2]
    finally:
        gate.set()
        _close(tm)


def test_blocks_that_flush_only_as_backward_ends_are_not_read_into_the_workers_places(tmp_path, monkeypatch):
    """A block whose gradients flush only as backward ends (reduced at the end; a parameter that got no
    gradient) is updated after blocks that were never read in: had forward read it into a worker's
    place, the host would hold more states than the budget counts. Once a backward shows that, forward
    keeps to the read-ahead places; the exact budget holds and the losses are plain PyTorch's."""
    plan = disk_plan("overlap", stream=False, workers=1, read_ahead=1)
    blocks = find_blocks(_fresh(TINY4)[0])
    host = needs(blocks, plan, PAGE)[Tier.HOST]
    want = train_plain(TINY4, 4, 1, None)
    tm, topt = _setup(tmp_path, plan, host)
    rt = tm.runtime
    monkeypatch.setattr(BlockGroup, "reduces_at_end", property(lambda g: True))  # every group flushes at the end
    losses: list[float] = []
    try:
        for batch in batches(4):
            _settle_writes(tm)
            loss = lm_loss(tm, batch[:, :-1], batch[:, 1:])
            assert len(rt.moves._reads) == 1
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
        assert rt.mem.stats()["host"]["pages_peak_bytes"] <= host
    finally:
        _close(tm)
    assert losses == want


def test_blocks_with_experts_are_not_read_into_the_workers_places(tmp_path):
    """An expert that gets no token in a step leaves its block's gradients to flush at backward's end, and
    which experts get tokens depends on the data: so forward never reads a block with experts into the
    update workers' places, even when every expert got tokens so far."""
    moe = {**TINY4, "n_experts": 4, "top_k": 2}
    plan = disk_plan("overlap", stream=False, workers=1, read_ahead=1)
    blocks = find_blocks(_fresh(moe)[0])
    tm, topt = _setup(tmp_path, plan, needs(blocks, plan, PAGE)[Tier.HOST], spec=moe)
    rt = tm.runtime
    losses: list[float] = []
    try:
        data = batches(3)
        _step(tm, topt, data[0], losses)
        _step(tm, topt, data[1], losses)
        rt._late_flushes = set()  # as after steps in which every expert got tokens
        _settle_writes(tm)
        lm_loss(tm, data[2][:, :-1], data[2][:, 1:])
        assert len(rt.moves._reads) == 1
    finally:
        _close(tm)


def test_spare_host_memory_reads_more_blocks_ahead_within_the_budget(tmp_path):
    """``setup`` widens read-ahead to what the host budget holds, up to every disk-homed block, and
    no further than the budget: at the base plan's exact need it stays as asked."""
    plan = disk_plan("overlap", stream=False, workers=1, read_ahead=1)
    blocks = find_blocks(_fresh(TINY4)[0])
    base = needs(blocks, plan, PAGE)[Tier.HOST]
    roomy = needs(blocks, dataclasses.replace(plan, read_ahead=5), PAGE)[Tier.HOST]
    assert base < roomy
    assert widest_read_ahead(block_sizes(blocks), plan, PAGE, budgets(tmp_path, base)).read_ahead == 1
    assert widest_read_ahead(block_sizes(blocks), plan, PAGE, budgets(tmp_path, roomy - 1)).read_ahead < 5
    assert widest_read_ahead(block_sizes(blocks), plan, PAGE, budgets(tmp_path, 1 << 30)).read_ahead == 5  # 4 blocks + rest
    want = train_plain(TINY4, 4, 1, None)
    for host in (base, roomy):
        model, opt = _fresh(TINY4)
        tm, topt = tiertrain.setup(model, opt, budgets(tmp_path, host), plan=plan, page_size=PAGE)
        try:
            assert _loop(tm, topt, tm.clip_grad_norm_, 4, 1, None) == want
            assert tm.runtime.mem.stats()["host"]["pages_peak_bytes"] <= host
        finally:
            _close(tm)
