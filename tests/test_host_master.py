"""A disk-homed block's master kept on the host (``BlockPlan.host_master``): only its moments cross
to disk. The runtime's side (plain PyTorch bitwise, the bytes moved) is tested with the other plans
(test_runtime's random plans, test_pieces, test_lockfree, test_data_parallel, test_replan,
test_step_bytes); here, how the planner spends the host on it, and the page size the host is
counted in."""

import dataclasses

import pytest

from tiered_harness import train_plain, train_tiered
from tiertrain.memory import Budgets
from tiertrain.plan import BlockPlan, Plan
from tiertrain.plan.bytes import pages
from tiertrain.plan.fit import host_masters, page_for_states, tier_bytes
from tiertrain.plan.tiers import Tier
from tiertrain.planner.auto import to_plan
from tiertrain.planner.solvers import Problem

PAGE = 64 << 10
BLOCK = 200_000       # parameters of each block: seven streamed, the eighth resident
NUMELS = [BLOCK] * 8 + [500_000]


def _on_disk() -> Plan:
    """Blocks on disk, the rest (embeddings, head) on the device; one block read ahead and one
    optimizer worker, so that the host stages two blocks' states and every master beyond costs."""
    blocks = tuple(BlockPlan(home=Tier.DISK, stream=i < 7) for i in range(8))
    return Plan(blocks, BlockPlan(home=Tier.DEVICE), window=2, prefetch=1, update="overlap", read_ahead=0,
                update_workers=1)


def _budgets(host: int) -> dict[Tier, int]:
    return {Tier.DEVICE: 1 << 30, Tier.HOST: host, Tier.DISK: 1 << 30}


def _host(plan: Plan) -> int:
    return tier_bytes(NUMELS, plan, PAGE)[Tier.HOST]


def test_the_host_left_goes_to_masters_first_then_whole_blocks_and_the_plan_always_fits():
    """Each budget from the plan's own need up: the plan returned fits it; masters are added as the
    budget grows (never taken back), a streamed block's (sparing its two compute reads too) before the
    resident one's; a whole block comes home only once every master is there."""
    plan = _on_disk()
    every = dataclasses.replace(plan, blocks=tuple(dataclasses.replace(b, host_master=True) for b in plan.blocks))
    master = pages(BLOCK * 4, PAGE)
    assert host_masters(NUMELS, plan, PAGE, _budgets(_host(plan))) == plan  # no room: as it was
    before = 0
    for host in range(_host(plan), _host(every) + 4 * master, master // 2):
        got = host_masters(NUMELS, plan, PAGE, _budgets(host)).blocks
        masters = sum(b.host_master or b.home is Tier.HOST for b in got)
        assert _host(dataclasses.replace(plan, blocks=got)) <= host and masters >= before
        if got[7].host_master:
            assert all(b.host_master or b.home is Tier.HOST for b in got[:7])
        if any(b.home is Tier.HOST for b in got):
            assert all(b.host_master or b.home is Tier.HOST for b in got)
        before = masters
    assert before == 8 and host_masters(NUMELS, plan, PAGE, _budgets(_host(every))) == every
    assert sum(b.host_master for b in host_masters(NUMELS, plan, PAGE, _budgets(_host(plan) + master)).blocks) == 1
    roomy = host_masters(NUMELS, plan, PAGE, _budgets(1 << 30))
    assert all(b.home is Tier.HOST and not b.host_master for b in roomy.blocks)


def _disk_bound(n_layer: int):
    """A fixed profile (the choice must not hang on this machine's measured rates) of the harness's
    model with ``n_layer`` blocks on a disk-bound machine, for an overlap run without clipping; and
    the blocks' sizes."""
    from tiered_harness import TINY4
    from tiertrain.models import build
    from tiertrain.planner.auto import run_profile
    from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile
    from tiertrain.runtime.blocks import block_numel, find_blocks

    blocks = find_blocks(build(dict(TINY4, n_layer=n_layer), device="meta"))
    prof = [BlockProfile(b.name, 1e-4, 2e-4, block_numel(b), 1 << 12, 1 << 10) for b in blocks]
    disk_bound = MachineProfile(h2d_bps=1e10, d2h_bps=1e10, disk_read_bps=1e7, disk_write_bps=1e7,
                                adam_params_per_s=1e9, device_is_host=True)
    profile = run_profile(Profile(tuple(prof[:-1]), prof[-1], disk_bound, page=PAGE), "overlap", 1, False)
    return profile, [block_numel(b) for b in blocks]


def test_the_planner_keeps_masters_on_the_host_it_has_and_the_plan_trains_as_plain_pytorch(tmp_path):
    """A disk-bound machine (a fixed profile: the choice must not hang on this one's measured rates)
    with host for some masters but not for whole blocks: the chosen plan keeps masters on the host,
    is predicted faster than the same plan without them, fits the runtime's own count, and trains
    as plain PyTorch does."""
    from tiered_harness import TINY4
    from tiertrain.models import build
    from tiertrain.planner.auto import choose
    from tiertrain.planner.simulator import simulate
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    spec = dict(TINY4, n_layer=12)
    blocks = find_blocks(build(spec, device="meta"))
    profile, numels = _disk_bound(12)
    all_disk = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in numels[:-1]), BlockPlan(home=Tier.DISK),
                    window=2, prefetch=1, update="overlap")
    host = tier_bytes(numels, all_disk, PAGE, grads="transient")[Tier.HOST] + 4 * pages(numels[0] * 4, PAGE)
    pb = Problem(profile, Budgets(device=1 << 20, host=host, disk=64 << 20))
    plan = choose(pb)[0].plan
    assert any(b.host_master for b in (*plan.blocks, plan.rest)), plan.to_json()
    without = dataclasses.replace(plan, blocks=tuple(dataclasses.replace(b, host_master=False) for b in plan.blocks),
                                  rest=dataclasses.replace(plan.rest, host_master=False))
    assert simulate(plan, profile).step_s < simulate(without, profile).step_s
    assert needs(blocks, plan, PAGE, transient_grads=True)[Tier.HOST] <= host
    got, stats = train_tiered(spec, 3, 1, None, plan, Budgets(device=1 << 20, host=host, disk=64 << 20,
                                                               disk_dir=str(tmp_path / "disk")))
    assert got == train_plain(spec, 3, 1, None)
    assert stats["host"]["pages_peak_bytes"] <= host


def test_the_planner_sends_the_solvers_host_homed_blocks_to_disk_where_every_master_fits_instead(monkeypatch):
    """Host for every block's master beside its disk pipeline, not for whole blocks: the solvers keep
    two blocks' whole states on the host (32 B of traffic spared a parameter for 12 B), the planner
    spends the same host on every master (16 B for 4 B) and predicts that faster (with the plan's own
    pipeline: the lean one frees host for whole blocks beside the masters, another trade)."""
    import tiertrain.planner.auto as auto
    from tiertrain.planner.auto import choose
    from tiertrain.planner.simulator import simulate
    from tiertrain.planner.solvers import SOLVERS

    profile, numels = _disk_bound(12)
    every = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True, host_master=True) for _ in numels[:-1]),
                 BlockPlan(home=Tier.DISK, host_master=True), window=2, prefetch=1, update="overlap")
    pb = Problem(profile, Budgets(device=1 << 20, host=tier_bytes(numels, every, PAGE, grads="transient")[Tier.HOST],
                 disk=64 << 20))
    assert all(not all(SOLVERS[name](pb).disk_home) for name in ("dp", "greedy"))  # blocks kept on the host
    with monkeypatch.context() as m:
        m.setattr(auto, "_pipelines", lambda plan, *_: [plan])
        chosen = choose(pb)[0]
    assert all(b.home is Tier.DISK and b.host_master for b in (*chosen.plan.blocks, chosen.plan.rest))
    kept = to_plan(SOLVERS["dp"](pb), profile, "overlap")
    assert chosen.sim.step_s < simulate(kept, profile).step_s


def test_where_host_is_short_the_planner_takes_the_lean_pipeline_for_more_masters(monkeypatch):
    """With host for about one master beside the default disk pipeline (two workers, blocks read
    ahead), the lean one (one worker, one block read ahead) stages three blocks' states fewer, so the
    host keeps more masters: on a disk-bound machine the planner predicts it faster and takes it,
    within the runtime's own count. With host for every master either way, the lean pipeline only
    waits longer, and the default one is kept."""
    import tiertrain.planner.auto as auto
    from conftest import needs
    from tiertrain.runtime.blocks import find_blocks
    from tiertrain.models import build
    from tiered_harness import TINY4

    profile, numels = _disk_bound(12)
    all_disk = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in numels[:-1]), BlockPlan(home=Tier.DISK),
                    window=2, prefetch=1, update="overlap")
    host = tier_bytes(numels, all_disk, PAGE, grads="transient")[Tier.HOST] + pages(numels[0] * 4, PAGE)
    pb = Problem(profile, Budgets(device=1 << 20, host=host, disk=64 << 20))
    chosen = auto.choose(pb)[0]
    assert (chosen.plan.update_workers, chosen.plan.read_ahead) == (1, 1), chosen.plan.to_json()
    blocks = find_blocks(build(dict(TINY4, n_layer=12), device="meta"))
    assert needs(blocks, chosen.plan, PAGE, transient_grads=True)[Tier.HOST] <= host
    with monkeypatch.context() as m:
        m.setattr(auto, "_pipelines", lambda plan, *_: [plan])
        default = auto.choose(pb)[0]
    assert default.plan.update_workers == 2
    assert sum(b.host_master for b in chosen.plan.blocks) > sum(b.host_master for b in default.plan.blocks)
    assert chosen.sim.step_s < default.sim.step_s
    every = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True, host_master=True) for _ in numels[:-1]),
                 BlockPlan(home=Tier.DISK, host_master=True), window=2, prefetch=1, update="overlap")
    roomy = pb.with_budgets(host=2 * tier_bytes(numels, every, PAGE, grads="transient")[Tier.HOST])
    assert auto.choose(roomy)[0].plan.update_workers == 2


@pytest.mark.parametrize("numel,page,want", [(12_596_224, 8 << 20, 2 << 20), (52_513_792, 8 << 20, 8 << 20)])
def test_the_page_size_is_cut_until_the_states_waste_little_as_the_budget_counts_them(numel, page, want):
    """A 354M GPT's 48 MiB state chunks took 64 MiB each in 8 MiB pages as the budget counts them (whole
    pages, and the one a chunk may share): a third of the host. Its blocks get 2 MiB pages; a chunk
    many pages long keeps the measured size."""
    got = page_for_states([numel] * 8, page)
    assert got == want
    waste = pages(numel * 4, got) - numel * 4
    assert waste <= 0.10 * numel * 4
    if got < page:
        assert pages(numel * 4, 2 * got) - numel * 4 > 0.10 * numel * 4  # the next size up wastes more


@pytest.mark.parametrize("update", ["lockfree", "overlap"])
def test_a_master_kept_on_the_host_is_the_streamed_blocks_param_home_no_copy_beside_it(update):
    """Under lockfree (or with ``param_copy``) a master that travels to disk needs a host copy of the
    compute params beside it (an update may have it in flight); one kept on the host does not, as a
    host-homed block's does not: 4 B a parameter of host saved."""
    from tiertrain.plan.bytes import separate_param_home

    plan = Plan((BlockPlan(),), update=update)
    for copy in (False, True):
        travels = BlockPlan(home=Tier.DISK, stream=True, param_copy=copy)
        kept = dataclasses.replace(travels, host_master=True)
        assert not separate_param_home(kept, plan)
        assert separate_param_home(travels, plan) is (copy or update == "lockfree")


def _short_host(device_is_host: bool, device: int) -> tuple[Problem, list[int]]:
    """A disk-bound machine (a fixed profile), 12 blocks of 4 MiB states each and 1 MiB of activations,
    host for the lean whole-block pipeline and two masters beside it; and the blocks' sizes."""
    from tiertrain.planner.auto import run_profile
    from tiertrain.planner.profile import BlockProfile, MachineProfile, Profile

    n = 1 << 20  # 4 MiB a state: larger than the smallest piece tried
    blocks = tuple(BlockProfile(f"blocks.{i}", 1e-3, 2e-3, n, 1 << 20, 1 << 12) for i in range(12))
    disk_bound = MachineProfile(h2d_bps=1e10, d2h_bps=1e10, disk_read_bps=1e8, disk_write_bps=1e8,
                                adam_params_per_s=1e9, device_is_host=device_is_host)
    profile = run_profile(Profile(blocks, BlockProfile("rest", 1e-4, 2e-4, n // 4, 1 << 12, 1 << 10), disk_bound,
                                  page=PAGE), "overlap", 1, False)
    numels = [n] * 12 + [n // 4]
    all_disk = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in blocks), BlockPlan(home=Tier.DISK),
                    window=2, prefetch=1, update="overlap", read_ahead=1, update_workers=1)
    host = tier_bytes(numels, all_disk, PAGE, grads="transient")[Tier.HOST] + 2 * pages(n * 4, PAGE)
    return Problem(profile, Budgets(device=device, host=host, disk=1 << 30)), numels


def _whole_only(pipelines):
    """``auto._pipelines`` without the variants in pieces."""
    return lambda plan, *a: [q for q in pipelines(plan, *a) if not any(b.piece for b in (*q.blocks, q.rest))]


def test_where_host_is_short_the_planner_updates_blocks_in_pieces_for_more_masters_and_fewer_disk_bytes(monkeypatch):
    """A worker updating a block in pieces stages a few pieces, not the block's states, so the host
    that held whole blocks for the update pipeline holds masters instead: on a disk-bound machine the
    planner predicts that faster than any whole-block pipeline and takes it, within the runtime's own
    count, and its step moves fewer disk bytes (measured on a 354M GPT at 2 GiB: 5.1 GB a step against
    6.6). With host for every master beside whole blocks, pieces spare nothing and are not taken."""
    import tiertrain.planner.auto as auto

    pb, numels = _short_host(device_is_host=True, device=64 << 20)
    host, n = pb.host, numels[0]
    chosen = auto.choose(pb)[0]
    with monkeypatch.context() as m:
        m.setattr(auto, "_pipelines", _whole_only(auto._pipelines))
        whole = auto.choose(pb)[0]
    assert any(b.piece for b in chosen.plan.blocks) and not any(b.piece for b in whole.plan.blocks)
    assert sum(b.host_master for b in chosen.plan.blocks) > sum(b.host_master for b in whole.plan.blocks)
    moved = [s.timeline.busy("disk_read") + s.timeline.busy("disk_write") for s in (chosen.sim, whole.sim)]
    assert moved[0] < moved[1] and chosen.sim.step_s < whole.sim.step_s
    assert tier_bytes(numels, chosen.plan, PAGE, grads="transient")[Tier.HOST] <= host
    every = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True, host_master=True) for _ in numels[:-1]),
                 BlockPlan(home=Tier.DISK, host_master=True), window=2, prefetch=1, update="overlap")
    roomy = pb.with_budgets(host=2 * tier_bytes(numels, every, PAGE, grads="transient")[Tier.HOST])
    assert not any(b.piece for b in auto.choose(roomy)[0].plan.blocks)


def test_on_a_gpu_pieces_whose_gradients_leave_activations_no_room_in_the_device_budget_are_not_taken(monkeypatch):
    """Pieces keep their gradients on the device; on a GPU the activations share its budget with them
    (the budget check counts no activations, the simulator does). Where the whole-block plan fits the
    budget with its activations and the pieces would not, the planner keeps whole blocks; with room for
    both, it takes the pieces there too."""
    import tiertrain.planner.auto as auto

    tight, _ = _short_host(device_is_host=False, device=24 << 20)
    with monkeypatch.context() as m:
        m.setattr(auto, "_pipelines", _whole_only(auto._pipelines))
        whole = auto.choose(tight)[0]
    assert whole.sim.peaks["device"] <= tight.device
    chosen = auto.choose(tight)[0]
    assert chosen.sim.peaks["device"] <= tight.device and not any(b.piece for b in chosen.plan.blocks)
    roomy = tight.with_budgets(device=64 << 20)
    assert any(b.piece for b in auto.choose(roomy)[0].plan.blocks)
