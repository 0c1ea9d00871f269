"""A disk-homed block's update streamed through host a piece at a time (``runtime.pieces``): plain
PyTorch's numbers bit for bit, whatever cuts the parameters; the host holding pieces, not blocks;
and the plan cut into pieces only where whole blocks do not fit the host."""

import dataclasses

import pytest
import torch

import tiertrain
from conftest import made
from tiered_harness import _fresh, _loop, train_plain
from tiertrain.memory import Budgets, Kind, Tier
from tiertrain.plan import BlockPlan, Plan
from tiertrain.plan.bytes import in_pieces
from tiertrain.plan.fit import bounded_grads, pieces_to_fit, tier_bytes
from tiertrain.runtime.blocks import block_numel, find_blocks

PAGE = 4096
MODEL = {"n_layer": 2, "n_head": 2, "d_model": 64, "d_ffn": 128, "vocab_size": 256, "max_seq_len": 64}


def _plan(update: str = "sync", piece: int = 2 * PAGE, param_copy: bool = False, stream: bool = True,
          staleness: int = 1, host_master: bool = False) -> Plan:
    block = BlockPlan(home=Tier.DISK, stream=stream, param_copy=stream and param_copy, piece=piece,
                      host_master=host_master)
    return Plan((block,) * MODEL["n_layer"], BlockPlan(home=Tier.DISK, piece=piece, host_master=host_master),
                window=2, prefetch=1, update=update, max_staleness=staleness)


def _budgets(tmp_path, host: int = 4 << 20) -> Budgets:
    return Budgets(device=8 << 20, host=host, disk=64 << 20, disk_dir=str(tmp_path / "disk"))


def _train(tmp_path, plan: Plan, steps: int, accum: int = 1, clip: float | None = None, host: int = 4 << 20):
    model, opt = _fresh(MODEL)
    tm, topt = tiertrain.setup(model, opt, _budgets(tmp_path, host), plan=plan, grad_accum=accum,
                               max_grad_norm=clip if plan.update == "overlap" else None, page_size=PAGE)
    try:
        losses = _loop(tm, topt, tm.clip_grad_norm_, steps, accum, clip)
        weights = {n: t.clone() for n, t in tm.state_dict().items()}  # the fp32 masters, read from disk
        stats = tm.runtime.mem.stats()
        ran = tm.runtime.plan
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    return losses, weights, stats, ran


@pytest.mark.parametrize("update,accum,clip,param_copy,host_master", [
    ("sync", 1, None, False, False), ("sync", 2, 1.0, True, False), ("overlap", 1, None, False, False),
    ("overlap", 2, 0.5, False, False), ("overlap", 1, None, True, False), ("sync", 2, 1.0, False, True),
    ("overlap", 1, None, False, True)])
def test_updates_in_pieces_equal_plain_pytorch_bitwise(tmp_path, update, accum, clip, param_copy, host_master):
    want = train_plain(MODEL, 3, accum, clip)
    got, _, stats, ran = _train(tmp_path, _plan(update, param_copy=param_copy, host_master=host_master), 3, accum,
                                clip)
    assert got == want
    assert all(in_pieces(b) for b in (*ran.blocks, ran.rest))
    largest = max(block_numel(b) for b in find_blocks(_fresh(MODEL)[0])) * 4
    assert largest >= 8 * 2 * PAGE  # every block's states are cut into many pieces, parameters across them
    assert (stats["disk"]["peak_by_kind"].get("master", 0) > 0) is not host_master  # a host master never travels
    assert stats["disk"]["peak_by_kind"]["exp_avg"] > 0


@pytest.mark.parametrize("host_master", [False, True])
def test_lockfree_in_pieces_at_staleness_0_equals_plain_pytorch(tmp_path, host_master):
    want = train_plain(MODEL, 3, 1, None)
    got, _, _, _ = _train(tmp_path, _plan("lockfree", staleness=0, host_master=host_master), 3)
    assert got == want


@pytest.mark.parametrize("update,host_master", [("sync", False), ("overlap", False), ("overlap", True)])
def test_weights_after_updates_in_pieces_are_plain_pytorchs(tmp_path, update, host_master):
    model, opt = _fresh(MODEL)
    _loop(model, opt, None, 2, 1, None)
    _, weights, _, _ = _train(tmp_path, _plan(update, host_master=host_master), 2)
    for n, p in model.named_parameters():
        assert torch.equal(weights[n], p.detach()), n


def test_the_host_holds_pieces_not_blocks(tmp_path):
    """The host's peak of states is a few pieces per worker, far below one block's states."""
    _, _, stats, ran = _train(tmp_path, _plan("sync"), 2)
    host = stats["host"]["peak_by_kind"]
    block_states = max(block_numel(b) for b in find_blocks(_fresh(MODEL)[0])) * 4 * 3
    staged = sum(host.get(k.value, 0) for k in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ))
    assert 0 < staged <= ran.update_workers * 3 * 3 * 2 * PAGE < block_states / 2
    assert host.get(Kind.GRAD.value, 0) == 0  # the gradients wait on the device
    numels = [block_numel(b) for b in find_blocks(_fresh(MODEL)[0])]
    assert stats["host"]["pages_peak_bytes"] <= tier_bytes(numels, ran, PAGE)[Tier.HOST]  # counted as held


def test_a_host_too_small_for_whole_blocks_cuts_the_plan_into_pieces_that_fit(tmp_path):
    blocks = find_blocks(_fresh(MODEL)[0])
    numels = [block_numel(b) for b in blocks]
    whole = _plan(piece=0)
    have = {Tier.DEVICE: 8 << 20, Tier.HOST: 256 << 10, Tier.DISK: 64 << 20}
    assert tier_bytes(numels, whole, PAGE)[Tier.HOST] > have[Tier.HOST]
    cut = pieces_to_fit(numels, whole, PAGE, have)
    assert tier_bytes(numels, cut, PAGE)[Tier.HOST] <= have[Tier.HOST]
    assert all(b.piece and b.piece % PAGE == 0 for b in (*cut.blocks, cut.rest))
    roomy = dict(have, **{Tier.HOST: 64 << 20})
    assert pieces_to_fit(numels, whole, PAGE, roomy) == whole  # whole blocks fit: left as they are
    want = train_plain(MODEL, 2, 1, None)
    got, _, _, ran = _train(tmp_path, whole, 2, host=256 << 10)  # setup cuts it, and it trains exactly
    assert got == want and any(b.piece for b in ran.blocks)


def test_a_piece_on_a_block_not_homed_on_disk_is_refused():
    plan = dataclasses.replace(_plan(), rest=BlockPlan(home=Tier.HOST, piece=PAGE))
    with pytest.raises(tiertrain.ConfigError, match="piece"):
        plan.validate(MODEL["n_layer"])


@pytest.mark.parametrize("vocab", [256, 8192])
def test_overlap_without_clipping_bounds_the_gradients_waiting_on_the_device(tmp_path, vocab):
    """Transient gradients (overlap, no clipping): a device budget too small for every block's gradients
    is enough for ``update_workers + 1`` of them; backward waits for an update to free one. With a wide
    vocabulary the embeddings' chunk is several blocks' size: kept at the pool's far end, it always
    finds its run again, where the holes the blocks' chunks leave would split it."""
    spec = dict(MODEL, n_layer=4, vocab_size=vocab)
    blocks = find_blocks(_fresh(spec)[0])
    numels = [block_numel(b) for b in blocks]
    plan = dataclasses.replace(_plan("overlap"), blocks=(_plan().blocks[0],) * 4, update_workers=1)
    few = tier_bytes(numels, plan, PAGE, grads="transient")[Tier.DEVICE]
    assert tier_bytes(numels, plan, PAGE, grads="all")[Tier.DEVICE] > few
    model, opt = _fresh(spec)
    budgets = dataclasses.replace(_budgets(tmp_path), device=few)
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, page_size=PAGE)
    try:
        assert tm.runtime.bounded_grads  # bounded: all of them would not fit
        got = _loop(tm, topt, None, 5, 1, None)
        peak = tm.runtime.mem.stats()["device"]["peak_by_kind"]["grad"]
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert got == train_plain(spec, 5, 1, None)
    assert peak <= bounded_grads(numels, plan, PAGE)[Tier.DEVICE] < sum(numels) * 4


def test_the_planner_plans_pieces_where_no_whole_block_update_fits_the_host_and_the_runtime_accepts_them(tmp_path):
    """A wide vocabulary's embeddings and head: one block whose states the host cannot hold. The
    planner finds no plan with whole-block updates, then plans them in pieces; the plan fits the
    runtime's own check (which counts the pieces and the gradients waiting on the device), and the
    planner's host figure is the runtime's."""
    from tiertrain.measure.analytic import analytic_profile
    from tiertrain.models import ModelConfig, build
    from tiertrain.planner.auto import NoPlanFits, choose, run_profile
    from tiertrain.planner.solvers import Problem, feasible
    from conftest import needs

    cfg = ModelConfig(n_layer=4, n_head=4, d_model=128, d_ffn=512, vocab_size=32768, max_seq_len=64, name="wide")
    page = 64 << 10
    blocks = find_blocks(build(cfg, device="meta"))
    prof = run_profile(dataclasses.replace(analytic_profile(cfg, 2, 32, "fp32", str(tmp_path)), page=page),
                       "overlap", 1, needs_all_grads=False)
    rest_states = prof.rest.params * 12
    pb = Problem(prof, Budgets(device=64 << 20, host=rest_states // 4, disk=1 << 30))
    whole = dataclasses.replace(prof, read_ahead=1, update_workers=1)
    assert not feasible(pb) and not feasible(dataclasses.replace(pb, profile=whole))
    chosen, _ = choose(pb)
    plan = chosen.plan
    assert plan.rest.home is Tier.DISK and plan.rest.piece > 0
    need = needs(blocks, plan, page, transient_grads=True)
    assert need[Tier.HOST] <= pb.host and need[Tier.DEVICE] <= pb.device
    with pytest.raises(NoPlanFits):  # no disk: nowhere to stream the pieces from
        choose(pb.with_budgets(disk=0))


def _churn(table, sizes: list[int], alive: int, steps: int, top: int) -> None:
    """Bounded gradients as a transient run makes them: in backward order each block's chunk is taken
    once fewer than ``alive`` are alive, the oldest freed first (its update ended); every step ends
    with all freed (the next forward waits for the updates)."""
    from collections import deque

    for _ in range(steps):
        held: deque = deque()
        for n in sizes:
            if len(held) == alive:
                table.release(held.popleft())
            held.append(table.allocate(n, contiguous=True, top=n == top))
        while held:
            table.release(held.popleft())


def test_bounded_gradients_of_mixed_sizes_always_find_their_run_in_what_the_budget_counts():
    """The layout the runtime gives bounded grad chunks (the largest at the pool's far end, the others
    all one size) never fragments a pool of exactly what ``alive_grad_bytes`` counts; the same chunks
    in a pool of the sum of the largest ``alive`` sizes (what was counted before) do not fit."""
    from tiertrain.memory.pages import PageTable, PagesExhausted
    from tiertrain.plan.fit import alive_grad_bytes

    page, workers = 4096, 1
    blocks, rest = [243 * page] * 8, 456 * page  # the 24-layer d=2304 GPT's proportions: embeddings = 1.9 blocks
    sizes = blocks[::-1] + [rest]  # backward order: the blocks, then the embeddings and head
    need = alive_grad_bytes(sizes, workers, 1, page, bound=False)
    _churn(PageTable(need // page, page, share_pages=True), sizes, workers + 1, 3, top=rest)
    before = sum(sorted(sizes, reverse=True)[: workers + 1])
    with pytest.raises(PagesExhausted):
        _churn(PageTable(before // page, page, share_pages=True), sizes, workers + 1, 3, top=0)


@pytest.mark.parametrize("host_master", [False, True])
def test_a_run_updated_in_pieces_checkpoints_a_parameter_at_a_time_and_resumes_bitwise(tmp_path, monkeypatch,
                                                                                        host_master):
    """Its checkpoint streams each parameter's master and moments from disk on their own, and a resume
    writes them back so (never a whole block's tensor: that is what the host cannot hold); resuming
    continues the uninterrupted run bit for bit."""
    from conftest import tiny_config
    from tiertrain.train.loop import train
    from tiertrain.memory import MemorySystem

    def whole_chunk(self, chunk):
        if chunk.tier is Tier.DISK:
            pytest.fail(f"{chunk!r} read whole")
        return original(self, chunk)
    original = MemorySystem.to_tensor
    monkeypatch.setattr(MemorySystem, "to_tensor", whole_chunk)
    from tiertrain.runtime import state_io

    def flat(st, tensors):
        if in_pieces(st.plan):
            pytest.fail(f"{st.block.name} made whole to be written")
        return flat_of(st, tensors)
    flat_of = state_io._flat
    monkeypatch.setattr(state_io, "_flat", flat)
    plan = tmp_path / "pieces.json"  # the "tiny" model: two blocks, each cut into several pieces of two pages
    plan.write_text(_plan("overlap", host_master=host_master).to_json())
    kw = dict(steps=4, plan=str(plan), disk=f"{tmp_path / 'disk'}:64MiB", page_size="4KiB", update="overlap",
              grad_clip=0.0, save_every=2, keep_checkpoints=5)
    full = train(tiny_config(tmp_path / "full", **kw))
    resumed = train(tiny_config(tmp_path / "resumed", resume=str(tmp_path / "full/checkpoints/step-00000002"), **kw))
    assert resumed.losses == full.losses[2:]


def test_bf16_updates_in_pieces_equal_whole_block_updates_and_stage_nothing_whole_at_setup(tmp_path):
    """bf16 compute with an fp32 master: pieces change no bit against whole-block updates, and setup
    writes each block's master a parameter at a time, so a host budget of exactly what the plan counts
    (a few pieces) is enough from the start."""
    def run(plan: Plan, host: int) -> list[float]:
        model, opt = _fresh(MODEL)
        tm, topt = tiertrain.setup(model, opt, _budgets(made(tmp_path / f"d{host}"), host), plan=plan, page_size=PAGE,
                                   compute_dtype="bf16")
        try:
            return _loop(tm, topt, None, 3, 1, None)
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()

    pieced = dataclasses.replace(_plan("sync"), compute_dtype="bf16")
    numels = [block_numel(b) for b in find_blocks(_fresh(MODEL)[0])]
    exact = tier_bytes(numels, pieced, PAGE)[Tier.HOST]
    whole = dataclasses.replace(pieced, blocks=tuple(dataclasses.replace(b, piece=0) for b in pieced.blocks),
                                rest=dataclasses.replace(pieced.rest, piece=0))
    assert run(pieced, exact) == run(whole, 16 << 20)


def test_a_sync_run_that_fits_only_in_pieces_is_told_how(tmp_path):
    """In sync mode every block's gradients wait for the step, so pieces (whose gradients wait on the
    device) do not help; the refusal says the run fits in pieces when gradients are updated away."""
    from tiertrain.plan.fit import PlanDoesNotFit, check_fits

    blocks = find_blocks(_fresh(MODEL)[0])
    numels = [block_numel(b) for b in blocks]
    whole = _plan("sync", piece=0)
    host = 256 << 10
    have = _budgets(tmp_path, host)
    cut = pieces_to_fit(numels, whole, PAGE, {Tier.DEVICE: have.device, Tier.HOST: host, Tier.DISK: have.disk},
                        "transient")
    assert cut is not whole
    with pytest.raises(PlanDoesNotFit, match="updated in pieces .* --update overlap --grad-clip 0"):
        check_fits(numels, whole, have, PAGE)


def test_a_piece_buffer_refused_part_way_frees_those_alreadymade(tmp_path, monkeypatch):
    """The host refuses the second buffer of a piece's set: the update fails with that refusal, and
    every buffer made before it goes back to the pool (none is left holding host pages)."""
    from tiertrain.errors import BudgetError
    from tiertrain.memory import MemorySystem

    model, opt = _fresh(MODEL)
    tm, topt = tiertrain.setup(model, opt, _budgets(tmp_path), plan=_plan("sync"), page_size=PAGE)
    try:
        _loop(tm, topt, None, 1, 1, None)
        mem = tm.runtime.mem
        before = mem.stats()["host"]["pages_in_use_bytes"]
        allocate, made = MemorySystem.allocate, []

        def refuse_second(self, name, nbytes, tier, *args, **kwargs):
            if name.endswith(".piece"):
                made.append(name)
                if len(made) == 2:
                    raise BudgetError("host", nbytes, nbytes, 0)
            return allocate(self, name, nbytes, tier, *args, **kwargs)
        monkeypatch.setattr(MemorySystem, "allocate", refuse_second)
        with pytest.raises(BudgetError):
            _loop(tm, topt, None, 1, 1, None)
        monkeypatch.setattr(MemorySystem, "allocate", allocate)
        assert len(made) == 2 and mem.stats()["host"]["pages_in_use_bytes"] == before
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
