"""The simulator's timeline and its model of the runtime's update pipeline (``planner.timeline``,
``planner.updates``): workers, states read ahead, the next step's wait for updates, bounded gradients."""

import dataclasses

import pytest

from tiertrain.memory import Tier
from tiertrain.plan import BlockPlan, Plan
from tiertrain.plan.parallel import ParallelLayout
from tiertrain.plan.reads import ForwardReads, forward_reads
from tiertrain.planner.simulator import simulate
from tiertrain.planner.timeline import Timeline
from test_planner import synthetic


def _task(sim, label: str) -> tuple[float, float]:
    (span,) = [(s, e) for _, s, e, lab in sim.timeline.tasks if lab == label]
    return span


def _disk_plan(n: int = 6, read_ahead: int = 2, workers: int = 2, **block) -> Plan:
    b = BlockPlan(home=Tier.DISK, **block)
    return Plan((b,) * n, BlockPlan(), window=1, prefetch=0, update="overlap", name="disk",
                read_ahead=read_ahead, update_workers=workers)


def _slow_disk(prof, bps: float = 1e8):
    return dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, disk_read_bps=bps, disk_write_bps=bps))


def test_a_task_fills_the_first_gap_it_fits_and_reads_and_writes_share_the_disk():
    tl = Timeline()
    assert tl.run("disk_read", 10.0, 2.0, "late") == (10.0, 12.0)
    assert tl.run("disk_read", 0.0, 3.0, "early") == (0.0, 3.0)        # before the later task, in the gap
    assert tl.run("disk_read", 8.0, 3.0, "too long") == (12.0, 15.0)   # 8..11 overlaps 10..12: after it
    assert tl.run("disk_write", 1.0, 1.0, "write") == (3.0, 4.0)       # the disk is busy reading until 3
    assert tl.run("cpu", 1.0, 1.0, "adam") == (1.0, 2.0)               # another resource is free
    assert tl.run("disk_read", 3.5, 0.0, "nothing") == (4.0, 4.0)      # an empty task is not recorded
    assert tl.busy("disk_read") == 8.0 and tl.busy("disk_write") == 1.0


def test_a_disk_that_reads_and_writes_at_once_gets_a_lane_each_at_its_rates_beside_the_other():
    """Equal rates: in turns, B bytes each way take 2B/r. At a gain of 2 both lanes go at full rate
    (B/r); at 1.5 each goes at 3/4 of it; at 1 (no gain) they take turns on one lane."""
    prof, plan = _slow_disk(synthetic(8)), _disk_plan(8)

    def at(gain: float):
        return simulate(plan, dataclasses.replace(prof, machine=dataclasses.replace(prof.machine,
                                                                                   disk_together_gain=gain)))

    turns, side, half = at(1.0), at(2.0), at(1.5)
    assert dataclasses.replace(prof.machine, disk_together_gain=4.0).disk_lanes().disk_read_bps == 1e8  # at most alone
    # reads twice as fast as writes: in turns B/2r + B/r; 1.5x that at once is B/r, both lanes at full rate
    uneven = dataclasses.replace(prof.machine, disk_read_bps=2e8, disk_together_gain=1.5).disk_lanes()
    assert (uneven.disk_read_bps, uneven.disk_write_bps) == pytest.approx((2e8, 1e8))

    def overlap(sim) -> float:
        spans = {r: [(s, e) for res, s, e, _ in sim.timeline.tasks if res == r] for r in ("disk_read", "disk_write")}
        return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in spans["disk_read"] for s2, e2 in spans["disk_write"])

    assert overlap(turns) == 0 and overlap(side) > 0 and overlap(half) > 0
    for r in ("disk_read", "disk_write"):  # the same bytes in each
        assert side.timeline.busy(r) == pytest.approx(turns.timeline.busy(r))
        assert half.timeline.busy(r) == pytest.approx(turns.timeline.busy(r) * 4 / 3)
    disk = turns.timeline.busy("disk_read") + turns.timeline.busy("disk_write")
    assert turns.step_s >= disk and side.step_s < turns.step_s
    lanes = side.timeline.busy("disk_read"), side.timeline.busy("disk_write")
    assert max(lanes) <= side.step_s < sum(lanes)  # the disk no longer adds its reads and writes up
    # a sync step reads, then writes: on two lanes each would run at its shared rate with the other
    # idle, so a small gain must not make it slower than taking turns at the rates alone
    sync = dataclasses.replace(plan, update="sync")
    for gain in (1.1, 1.2, 1.5):
        slow = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, disk_together_gain=gain))
        assert simulate(sync, slow).step_s <= simulate(sync, prof).step_s


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("read_ahead", [1, 2, 3])
def test_the_host_never_holds_more_blocks_states_than_the_budget_counts(read_ahead, workers):
    """A disk-homed block's states are in the host from its read's start until its write-back lands:
    never more blocks at once than ``plan.bytes.tier_bytes`` counts places for (read ahead, being
    updated, being written back: ``read_ahead + 2 * update_workers``), though forward reads into the
    workers' places too."""
    prof = _slow_disk(synthetic(8))
    sim = simulate(_disk_plan(8, read_ahead=read_ahead, workers=workers), prof)
    held = [(_task(sim, f"read {b.name}")[0], _task(sim, f"write {b.name}")[1]) for b in prof.blocks]
    most = max(sum(1 for s, e in held if s <= start < e) for start, _ in held)
    assert most == read_ahead + 2 * workers
    # on a disk fast enough, the first blocks backward reaches are read during forward, into every place
    fast = simulate(_disk_plan(8, read_ahead=read_ahead, workers=workers), _slow_disk(synthetic(8), 1e11))
    backward = _task(fast, f"bwd {prof.blocks[-1].name}")[0]
    early = sorted(b.name for b in prof.blocks if _task(fast, f"read {b.name}")[1] < backward)
    assert early == sorted(b.name for b in prof.blocks[-(read_ahead + 2 * workers):])
    # where updates wait for the end of backward (clipping), they go in forward order: only read_ahead
    clipped = simulate(_disk_plan(8, read_ahead=read_ahead, workers=workers), _slow_disk(synthetic(8), 1e11),
                       needs_all_grads=True)
    early = sorted(b.name for b in prof.blocks if _task(clipped, f"read {b.name}")[1] < backward)
    assert early == sorted(b.name for b in prof.blocks[-read_ahead:])


def test_a_worker_starts_a_write_back_only_once_its_last_one_has_landed():
    """One write-back per worker in flight (what the budget counts): a worker's next block is read and
    updated while its last write-back still goes out, but it writes that block back, and so takes the
    block after, only once the last one has landed."""
    prof = _slow_disk(synthetic(6))
    order = [b.name for b in reversed(prof.blocks)]
    one = simulate(_disk_plan(6, read_ahead=3, workers=1), prof)
    assert any(_task(one, f"adam {after}")[0] < _task(one, f"write {before}")[1]
               for before, after in zip(order, order[1:]))
    for k in range(len(order) - 2):
        assert _task(one, f"adam {order[k + 2]}")[0] >= _task(one, f"write {order[k]}")[1] - 1e-12
    two = simulate(_disk_plan(6, read_ahead=3, workers=2), prof)
    assert any(_task(two, f"adam {order[k + 2]}")[0] < _task(two, f"write {order[k]}")[1]
               for k in range(len(order) - 2))


def test_the_next_forward_waits_for_the_updates_it_needs():
    """With AdamW far slower than compute and nothing else busy, an overlap step is as long as the
    update of the embeddings (the rest), which ends after backward and which the next step's forward
    needs first."""
    prof = synthetic(4)
    prof = dataclasses.replace(prof, machine=dataclasses.replace(prof.machine, adam_params_per_s=1e7,
                                                                 device_is_host=False))
    host = Plan((BlockPlan(home=Tier.HOST),) * 4, BlockPlan(), update="overlap", name="host")
    sim = simulate(host, prof)
    rest = _task(sim, "adam rest")
    assert sim.step_s == pytest.approx(rest[1])
    assert sim.step_s > sim.timeline.busy("cpu") * 0.99  # no shorter than the updates themselves either


def test_a_block_whose_slot_is_filled_from_its_master_on_disk_is_needed_after_its_write_back():
    """Such a block's next fetch reads the master its write-back puts on disk: the next step waits
    for the write, counted from when this step fetched the block."""
    prof = _slow_disk(synthetic(4), 5e7)
    b = BlockPlan(home=Tier.DISK, stream=True)
    plan = Plan((b,) * 4, BlockPlan(), window=2, prefetch=1, update="overlap", name="slot from disk",
                read_ahead=2, update_workers=2)
    sim = simulate(plan, prof)
    first = prof.blocks[0].name
    assert sim.step_s >= _task(sim, f"write {first}")[1] - _task(sim, f"fetch {first}")[0] - 1e-12


def test_backward_waits_for_room_for_gradients_where_the_runtime_bounds_them():
    """With gradients bounded to update_workers + 1 chunks, a block's gradients are flushed only once
    the update that many blocks back has freed its chunk."""
    from tiertrain.plan.fit import bounds_grads

    prof = dataclasses.replace(_slow_disk(synthetic(6)), transient_grads=True, page=1 << 20)
    plan = _disk_plan(6, read_ahead=1, workers=1)
    numels = [b.params for b in (*prof.blocks, prof.rest)]
    tight = {Tier.DEVICE: 1 << 40, Tier.HOST: 64 << 20, Tier.DISK: 1 << 40}
    assert bounds_grads(numels, plan, prof.page, tight, True)
    sim = simulate(plan, prof, budgets=tight)
    order = [b.name for b in reversed(prof.blocks)]
    for k in range(2, len(order)):
        assert _task(sim, f"grads {order[k]}")[0] >= _task(sim, f"adam {order[k - 2]}")[1] - 1e-12
    free = simulate(plan, prof)  # no budgets given: nothing bounds them
    assert any(_task(free, f"grads {order[k]}")[0] < _task(free, f"adam {order[k - 2]}")[1]
               for k in range(2, len(order)))


def test_a_block_updated_in_pieces_holds_its_worker_until_its_pieces_are_written():
    """``update_in_pieces`` returns once its last piece is written: its worker takes the next block (one
    homed on the host here, which reads nothing) only then."""
    prof = _slow_disk(synthetic(4))
    pieced, host = BlockPlan(home=Tier.DISK, piece=1 << 20), BlockPlan(home=Tier.HOST)
    plan = Plan((host, pieced, host, pieced), BlockPlan(), window=1, prefetch=0, update="overlap", name="pieces",
                read_ahead=1, update_workers=1)
    sim = simulate(plan, prof)
    for disk, after in ((3, 2), (1, 0)):
        assert _task(sim, f"adam b{after}")[0] >= _task(sim, f"write b{disk}")[1] - 1e-12


@pytest.mark.parametrize("clipped", [False, True])
def test_a_block_whose_slot_is_filled_from_its_master_on_disk_reads_its_moments_ahead_and_its_master_from_its_slot(
        clipped):
    """A streamed fp32 block whose slot is filled from its master on disk, backward's first, before blocks
    whose masters stay on the host: forward reads only its moments (8 bytes a parameter, not 12; the master
    stays on disk, the slot is filled from it), and its master is copied from its slot as its backward
    begins. Forward reads no block beyond the places it may fill: the one read-ahead place, and where
    updates follow backward (not clipped) the worker's two as well."""
    prof = synthetic(6)
    plan = _disk_plan(6, read_ahead=1, workers=1, stream=True)
    kept = dataclasses.replace(plan.blocks[0], host_master=True)
    plan = dataclasses.replace(plan, blocks=(kept,) * 5 + plan.blocks[5:])
    sim = simulate(plan, prof, needs_all_grads=clipped)
    first = prof.blocks[-1]
    read, backward = _task(sim, f"read {first.name}"), _task(sim, f"bwd {first.name}")
    forward_end = _task(sim, f"fwd {first.name}")[1]
    assert read[1] <= forward_end                           # during forward
    assert read[1] - read[0] == pytest.approx(first.params * 8 / prof.machine.disk_read_bps)
    copy = _task(sim, f"master {first.name} from its slot")
    assert forward_end <= copy[0] <= backward[0]           # as its backward begins
    early = {lab for _, s, _, lab in sim.timeline.tasks if lab.startswith("read ") and s < forward_end}
    assert early == {f"read {b.name}" for b in prof.blocks[-(1 if clipped else 3):]}


def test_a_sharded_block_read_during_forward_without_its_master_reads_that_master_for_its_update():
    """Over two ranks a slot filled from the master on disk is gathered from every rank's share, so no
    master comes from a slot: a block whose moments forward read must read its master share from disk
    for its update (``StateMoves.bring_in``). Every byte of a step's reads is counted: each block's own
    share filled into its slot in forward, again in backward (but the last, still there), and its
    states (12 bytes a parameter)."""
    prof = synthetic(6)
    plan = _disk_plan(6, read_ahead=1, workers=1, stream=True, shard=True)
    plan = dataclasses.replace(plan, parallel=ParallelLayout(dp=2))
    sim = simulate(plan, prof)
    share = prof.blocks[0].params // 2
    fills = (6 + 5) * share * prof.compute_bytes
    read = sim.timeline.busy("disk_read") * prof.machine.disk_read_bps
    assert read == pytest.approx(fills + 6 * share * 12)
    assert [lab for _, _, _, lab in sim.timeline.tasks if lab.endswith("'s master")]  # read for its update


def test_a_block_read_ahead_as_its_backward_begins_is_read_once_its_slot_is_filled():
    """The runtime reads a block's states ahead as its backward begins, after its fetch waited for the
    slot's fill (``Runtime.backward_begins``): so neither its moments' read nor its master's copy from
    the slot starts before that fill has landed (the fill goes first on the disk)."""
    prof = synthetic(8)
    plan = _disk_plan(8, read_ahead=1, workers=1, stream=True)
    sim = simulate(plan, prof)
    forward_end = _task(sim, f"fwd {prof.blocks[-1].name}")[1]
    copies = reads = 0
    for b in prof.blocks:
        copy = [s for _, s, _, lab in sim.timeline.tasks if lab == f"master {b.name} from its slot"]
        fill = [e for _, _, e, lab in sim.timeline.tasks if lab == f"fetch {b.name} (bwd)"]
        if copy and fill:
            assert copy[0] >= fill[0] - 1e-12
            copies += 1
            read = _task(sim, f"read {b.name}")
            if read[0] > forward_end:  # read as its backward began (not during forward)
                assert read[0] >= fill[0] - 1e-12
                reads += 1
    assert copies and reads


def test_forward_reads_the_first_disk_blocks_backward_reaches_and_none_without_read_ahead():
    """``plan.reads``: the first ``read_ahead`` disk-homed blocks in backward order, then the next
    ``2 * update_workers``; a block updated in pieces or homed elsewhere is passed over; ``read_ahead=0``
    reads nothing ahead at all (not even into the workers' places)."""
    plan = _disk_plan(6, read_ahead=1, workers=1)
    assert forward_reads(plan) == ForwardReads((5,), (4, 3))
    pieced, host = BlockPlan(home=Tier.DISK, piece=1 << 20), BlockPlan(home=Tier.HOST)
    mixed = dataclasses.replace(plan, blocks=plan.blocks[:3] + (host, pieced) + plan.blocks[5:])
    assert forward_reads(mixed) == ForwardReads((5,), (2, 1))
    assert forward_reads(dataclasses.replace(plan, read_ahead=2, update_workers=2)) == ForwardReads((5, 4), (3, 2, 1, 0))
    assert forward_reads(dataclasses.replace(plan, read_ahead=0)) == ForwardReads((), ())
    sim = simulate(dataclasses.replace(plan, read_ahead=0), synthetic(6))
    forward_end = _task(sim, f"fwd {synthetic(6).blocks[-1].name}")[1]
    assert not [lab for _, s, _, lab in sim.timeline.tasks if lab.startswith("read ") and s < forward_end]
