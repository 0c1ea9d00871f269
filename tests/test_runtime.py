import dataclasses
import random

import pytest

from tiered_harness import HF_GPT2, TINY4, train_plain, train_tiered
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, Tier
from tiertrain.runtime.block_group import BlockGroup
from tiertrain.plan.fit import PlanDoesNotFit
from tiertrain.plan import BlockPlan, Plan

STEPS = 20
DEVICE_BUDGET = 8 << 20


def budgets(tmp_path) -> Budgets:
    return Budgets(device=DEVICE_BUDGET, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "disk"))


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model, accum, clip):
        key = (str(model), accum, clip)
        if key not in cache:
            cache[key] = train_plain(model, STEPS, accum, clip)
        return cache[key]

    return get


MODELS = {"gpt": TINY4, "moe": "tiny-moe", "transformers": HF_GPT2}  # 4 blocks: a 2-slot window turns


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("plan", ["resident", "stream", "max-offload"])
@pytest.mark.parametrize("update", ["sync", "overlap"])
@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.5)])
def test_builtin_plans_equal_plain_pytorch_bitwise(tmp_path, references, hf_runs, model, plan, update, accum, clip):
    if model == "transformers":
        ref, got, peak = hf_runs[f"{plan}/{update}/{accum}/{clip}"]
        assert got == ref and peak <= DEVICE_BUDGET
        return
    spec = MODELS[model]
    got, stats = train_tiered(spec, STEPS, accum, clip, plan, budgets(tmp_path), update=update)
    assert got == references(spec, accum, clip)
    assert stats["device"]["peak"] <= DEVICE_BUDGET


HF_CASES = [(p, u, a, c) for p in ("resident", "stream", "max-offload") for u in ("sync", "overlap")
            for a, c in ((1, None), (2, 0.5))]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """The transformers cases, plain and tiered, computed in one fresh process.

    In a full clean-clone suite run (~250 tests in one process) the tiered GPT-2 run once drifted by
    one ulp at step 2, deterministically, while every run in a fresh process is bitwise equal; the
    cause is not found yet (see the issue notes). The assertions are the same bitwise ones."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    here, disk = Path(__file__).resolve().parent, tmp_path_factory.mktemp("hf") / "disk"
    code = (f"import sys, json; sys.path.insert(0, {str(here)!r}); import conftest\n"
            "from tiered_harness import HF_GPT2, train_plain, train_tiered\n"
            "from tiertrain.memory import Budgets\n"
            f"b = Budgets(device={DEVICE_BUDGET}, host=64 << 20, disk=64 << 20, disk_dir={str(disk)!r})\n"
            f"refs, out = {{}}, {{}}\n"
            f"for plan, update, accum, clip in {HF_CASES!r}:\n"
            f"    ref = refs.setdefault((accum, clip), train_plain(HF_GPT2, {STEPS}, accum, clip))\n"
            f"    got, stats = train_tiered(HF_GPT2, {STEPS}, accum, clip, plan, b, update=update)\n"
            "    out[f'{plan}/{update}/{accum}/{clip}'] = [ref, got, stats['device']['peak']]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def random_plan(rng: random.Random, n_blocks: int) -> Plan:
    def block() -> BlockPlan:
        home = rng.choice(list(Tier))
        return BlockPlan(home=home, stream=rng.random() < 0.5, recompute=rng.random() < 0.5,
                         param_copy=rng.random() < 0.5, offload_hidden=rng.random() < 0.5,
                         host_master=(rng.random() < 0.5) and home is Tier.DISK)

    blocks = tuple(block() for _ in range(n_blocks))
    window = rng.randint(1, 3)
    return Plan(blocks, BlockPlan(home=rng.choice(list(Tier))), window=window, prefetch=rng.randint(0, window - 1),
                update=rng.choice(["sync", "overlap"]), name="random", cache=rng.randint(0, 2))


PLANS = [random_plan(random.Random(seed), 4) for seed in range(50)]


def test_the_random_plans_cover_every_switch_and_tier_combination():
    seen = {(b.home, b.stream, b.recompute, b.offload_hidden) for p in PLANS for b in p.blocks}
    assert len(seen) == len(Tier) * 2 * 2 * 2
    assert {(b.stream, b.param_copy, b.host_master) for p in PLANS for b in p.blocks if b.home is Tier.DISK} == {
        (s, c, m) for s in (True, False) for c in (True, False) for m in (True, False)}
    assert {p.update for p in PLANS} == {"sync", "overlap"}
    assert {p.window for p in PLANS} == {1, 2, 3} and {p.rest.home for p in PLANS} == set(Tier)
    assert {p.cache for p in PLANS} == {0, 1, 2}


@pytest.mark.parametrize("seed", range(50))
def test_random_valid_plans_equal_plain_pytorch_bitwise(tmp_path, references, seed):
    plan = PLANS[seed]
    accum, clip = [(1, None), (2, None), (1, 0.5), (3, 0.5)][seed % 4]
    got, stats = train_tiered(TINY4, STEPS, accum, clip, plan, budgets(tmp_path))
    assert got == references(TINY4, accum, clip), plan.to_json()
    assert stats["device"]["peak"] <= DEVICE_BUDGET and stats["device"]["pages_in_use_bytes"] <= DEVICE_BUDGET
    # the device pool mapped only the plan's count, and that was enough (an allocation past it raises)
    assert stats["device"]["reserved_bytes"] < DEVICE_BUDGET


@pytest.mark.parametrize("plan", ["resident", "stream", "max-offload"])
def test_the_device_pool_maps_what_the_plan_counts_and_leaves_the_rest_of_the_budget_to_activations(tmp_path, plan):
    """On a GPU torch allocates activations beside the pool and the planner counts them in the device
    budget: a pool of the whole budget put them on top of it."""
    import tiertrain
    from tiered_harness import _fresh
    from tiertrain.plan.fit import tier_bytes

    b = budgets(tmp_path)
    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, b, plan=plan, update="overlap", page_size=64 * 1024)
    try:
        rt, pool = tm.runtime, tm.runtime.mem.pool(Tier.DEVICE)
        grads = "transient" if rt.bounded_grads else "all"
        counted = tier_bytes(rt.sizes, rt.plan, pool.page_size, True, grads)[Tier.DEVICE]
        assert pool.capacity == counted < DEVICE_BUDGET
        with pytest.raises(RuntimeError, match="the plan's count is short, a bug in tiertrain"):
            rt.mem.allocate("beyond", counted + 1, Tier.DEVICE)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_a_run_that_replans_after_its_first_step_keeps_the_whole_device_budget(tmp_path):
    import tiertrain
    from tiered_harness import _fresh

    model, opt = _fresh(TINY4)
    tm, _ = tiertrain.setup(model, opt, budgets(tmp_path), plan="auto", page_size=64 * 1024)
    try:  # its plan after the first step is not known yet
        assert tm.runtime.mem.pool(Tier.DEVICE).capacity == DEVICE_BUDGET
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_plan_json_round_trips():
    for plan in PLANS[:5]:
        assert Plan.from_json(plan.to_json()) == plan
    kept = dataclasses.replace(PLANS[0], beside_pool=3 << 20, stash=1 << 20)  # what plan auto keeps for activations
    assert Plan.from_json(kept.to_json()) == kept != PLANS[0]


def test_a_plan_that_cannot_fit_is_refused_with_the_smallest_budgets(tmp_path):
    tiny = Budgets(device=64 * 1024, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "d"))
    with pytest.raises(PlanDoesNotFit, match=r"plan 'resident' does not fit: device needs .* Smallest budgets"
                                             r" for this plan: device .*with plan 'max-offload'"):
        train_tiered("tiny", 1, 1, None, "resident", tiny)
    assert not (tmp_path / "d").exists()  # refused before anything was allocated
    with pytest.raises(PlanDoesNotFit) as refused:  # max-offload itself: its own figures, said once
        train_tiered("tiny", 1, 1, None, "max-offload", dataclasses.replace(tiny, host=4096))
    assert "Smallest budgets for this plan: device" in str(refused.value)
    assert "with plan 'max-offload' and a disk" not in str(refused.value)


def test_bad_plans_and_options_are_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="plan has 1 block entries but the model has 2"):
        train_tiered("tiny", 1, 1, None, Plan((BlockPlan(),)), budgets(tmp_path))
    with pytest.raises(ConfigError, match="plan 'fastest' is neither a built-in plan"):
        train_tiered("tiny", 1, 1, None, "fastest", budgets(tmp_path))
    no_disk = Budgets(device=8 << 20, host=64 << 20)
    with pytest.raises(ConfigError, match="give a disk budget"):
        train_tiered("tiny", 1, 1, None, Plan((BlockPlan(home=Tier.DISK),) * 2), no_disk)
    # Without a disk, max-offload homes the states on the host instead, and trains.
    assert len(train_tiered("tiny", 2, 1, None, "max-offload", no_disk)[0]) == 2


@pytest.mark.parametrize("plan", ["stream", "max-offload"])
def test_inference_only_streams_blocks_for_forward_and_keeps_no_optimizer_state(tmp_path, plan):
    import torch

    import tiertrain
    from tiered_harness import batches
    from tiertrain.models import build

    torch.manual_seed(0)
    reference = build(TINY4).eval()
    x = batches(1)[0][:, :-1]
    with torch.no_grad():
        expected = reference(x)
    torch.manual_seed(0)
    model, opt = tiertrain.setup(build(TINY4).eval(), None, budgets(tmp_path), plan=plan, train=False,
                                 page_size=64 * 1024)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected) and torch.equal(model(x), expected)  # and again
        stats = model.runtime.mem.stats()
        assert opt is None and not any(k in stats["host"]["live_by_kind"] for k in ("master", "exp_avg", "grad"))
        assert stats["device"]["peak"] <= DEVICE_BUDGET
    finally:
        model.runtime.close()
        model.runtime.mem.close()


def test_a_model_built_on_the_meta_device_is_initialised_block_by_block_and_trains(tmp_path):
    import torch

    import tiertrain
    from conftest import train_losses
    from tiered_harness import batches
    from tiertrain.models import build

    model = build(TINY4, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan="max-offload", page_size=64 * 1024)
    ln = tm.blocks[0].ln1
    assert not ln.weight.is_meta and torch.equal(ln.weight, torch.ones_like(ln.weight))
    assert torch.equal(ln.bias, torch.zeros_like(ln.bias))
    w = tm.blocks[3].attn.qkv.weight
    assert 0.015 < float(w.detach().std()) < 0.025  # N(0, 0.02)
    losses = train_losses(tm, topt, batches(1) * 6)  # one batch, again and again: the loss must fall
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("plan,update", [("resident", "sync"), ("max-offload", "overlap")])
def test_each_gradient_leaves_autograds_tensor_for_the_pools_as_it_arrives(tmp_path, plan, update):
    """Autograd's gradient tensors live outside every budget: each moves into the pools as it arrives,
    so at any arrival no other parameter holds one (a block's whole 4 x params bytes would sit in
    RSS until its last gradient came, an untied head's through all of backward). Training still
    equals plain PyTorch (the bitwise tests above)."""
    import tiertrain
    from tiered_harness import _fresh, batches, lm_loss

    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan, update=update, page_size=64 * 1024)
    params = list(tm.parameters())
    held: list[int] = []
    for p in params:  # after the runtime's own hook, which takes the gradient
        p.register_post_accumulate_grad_hook(lambda _p: held.append(sum(q.grad is not None for q in params)))
    try:
        b = batches(1)[0]
        for _ in range(2):
            lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
            topt.step()
            topt.zero_grad()
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert len(held) == 2 * len(params) and max(held) == 0


@pytest.mark.parametrize("plan,update", [("resident", "sync"), ("max-offload", "overlap")])
def test_fp16_overflow_skips_the_step_and_backs_off_as_gradscaler_does(tmp_path, plan, update):
    """A scale of 2**24 overflows fp16 gradients: the step is skipped (weights and AdamW step
    counts untouched), the scale halves, and training resumes once it fits; plain PyTorch's
    autocast + GradScaler from the same scale skips as many steps."""
    import torch

    import tiertrain
    from tiered_harness import _fresh, batches
    from tiertrain.train.objective import lm_loss
    from tiertrain.runtime.state_io import export_state

    data = batches(1) * 24
    model, opt = _fresh(TINY4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    plain_scales = []
    for b in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, b[:, :-1], b[:, 1:])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        plain_scales.append(scaler.get_scale())

    model, opt = _fresh(TINY4)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan, update=update, compute_dtype="fp16",
                               page_size=64 * 1024)
    try:
        topt.loss_scaler.load_state_dict({"scale": 2.0**24})
        before = export_state(tm.runtime)[0]
        scales, losses = [], []
        for b in data:
            loss = lm_loss(tm, b[:, :-1], b[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            scales.append(topt.loss_scaler.get_scale())
            losses.append(loss.item())
            if len(scales) == 1:
                tm.runtime.wait_updates()
                weights, moments = export_state(tm.runtime)
                assert all(torch.equal(weights[k], before[k]) for k in before)
                assert all(float(v) == 0 for k, v in moments.items() if k.endswith("::step"))
        skipped = topt.loss_scaler.skipped
        assert skipped >= 1 and scales[:skipped] == [2.0**24 / 2**k for k in range(1, skipped + 1)]
        assert scales[skipped:] == [scales[skipped - 1]] * (len(scales) - skipped)  # no more overflows
        assert skipped == sum(1 for a, b in zip([2.0**24] + plain_scales, plain_scales) if b < a)
        assert losses[-1] < losses[skipped] - 0.5  # it trains once the scale fits
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_draining_waits_for_reads_no_update_followed(tmp_path, monkeypatch):
    """A block's states read in ahead whose update never came (a skipped fp16 step) are still moving
    when a checkpoint or the end drains the moves: the drain returns only once none of them moves
    (each disk page read is held back here, so the reads are surely still in flight when it begins)."""
    import time

    import tiertrain
    from tiered_harness import _fresh
    from tiertrain.memory.disk import DiskPool
    from tiertrain.plan import builtin_plan

    model, opt = _fresh(TINY4)
    tm, _ = tiertrain.setup(model, opt, budgets(tmp_path), plan=builtin_plan("max-offload", 4, disk=True),
                            page_size=64 * 1024)
    rt = tm.runtime
    try:
        read_page = DiskPool.read_page
        monkeypatch.setattr(DiskPool, "read_page", lambda self, page, out: (time.sleep(0.05), read_page(self, page, out)))
        g = rt.groups[1]
        assert rt.moves.read_ahead(g)
        assert any(c.pending is not None and not c.pending.done() for c in g.states)
        rt.moves.drain()
        assert all(c.pending is None or c.pending.done() for c in g.states)
        assert all(c.tier is Tier.HOST for c in g.on_disk)
    finally:
        rt.close()
        rt.mem.close()


@pytest.mark.parametrize("recompute", [False, True])
def test_offload_hidden_moves_saved_activations_to_the_host_and_brings_them_back(tmp_path, recompute, monkeypatch):
    """With recompute, exactly each block's input (the hidden state, 4 x 16 x 32 fp32) waits on the
    host; without, everything the block saves except its parameters; the gradients are unchanged."""
    import torch

    import tiertrain
    from tiered_harness import _fresh, batches
    from tiertrain.train.objective import lm_loss

    b = batches(1)[0]
    model, opt = _fresh(TINY4)
    lm_loss(model, b[:, :-1], b[:, 1:]).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model, opt = _fresh(TINY4)
    plan = Plan(tuple(BlockPlan(stream=True, recompute=recompute, offload_hidden=True) for _ in range(4)), window=2)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan, page_size=64 * 1024)
    try:
        names = [n for n, _ in tm.named_parameters()]
        host_grads = {}
        monkeypatch.setattr(BlockGroup, "update_now", lambda st, hypers, coef: host_grads.update(
            {n: v.clone() for (n, _), v in zip(st.block.params, st.grad_views())}))
        loss = lm_loss(tm, b[:, :-1], b[:, 1:])
        stashes = [tm.runtime.stashes[i] for i in range(4)]
        hidden = 4 * 16 * 32 * 4
        stashed = [s.stashed_bytes for s in stashes]
        if recompute:
            assert stashed == [hidden] * 4
        else:
            assert all(n > 4 * hidden for n in stashed)
        assert tm.runtime.mem.stats()["host"]["live_by_kind"].get("activation", 0) >= sum(stashed)
        loss.backward()
        topt.step()
        assert "activation" not in tm.runtime.mem.stats()["host"]["live_by_kind"]  # freed with the graph
        assert set(host_grads) == set(names) and all(torch.equal(host_grads[n], expected[n]) for n in names)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def belady_misses(trace: list[int], slots: int) -> int:
    """Offline MIN from a cold cache: on a miss with no free slot, evict what is needed furthest ahead."""
    held: set[int] = set()
    misses = 0
    for t, b in enumerate(trace):
        if b in held:
            continue
        misses += 1
        if len(held) == slots:
            ahead = trace[t + 1:]
            held.remove(max(held, key=lambda h: ahead.index(h) if h in ahead else len(trace)))
        held.add(b)
    return misses


def fewest_misses(trace: list[int], slots: int) -> int:
    """Every eviction choice tried: the true minimum, to check belady_misses against."""
    def go(t: int, held: frozenset) -> int:
        if t == len(trace):
            return 0
        b = trace[t]
        if b in held:
            return go(t + 1, held)
        if len(held) < slots:
            return 1 + go(t + 1, held | {b})
        return 1 + min(go(t + 1, (held - {h}) | {b}) for h in held)
    return go(0, frozenset())


def lru_misses(trace: list[int], slots: int) -> int:
    held: list[int] = []
    misses = 0
    for b in trace:
        if b in held:
            held.remove(b)
        else:
            misses += 1
            if len(held) == slots:
                held.pop(0)
        held.append(b)
    return misses


def test_belady_reference_is_optimal_on_random_traces():
    rng = random.Random(0)
    for _ in range(30):
        trace = [rng.randrange(5) for _ in range(rng.randint(4, 11))]
        slots = rng.randint(1, 3)
        assert belady_misses(trace, slots) == fewest_misses(trace, slots), (trace, slots)


ORDER = (0, 1, 2, 3, 1, 2)  # blocks 1 and 2 are used twice (shared weights, as in a Universal Transformer)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_the_device_cache_follows_the_recorded_order_with_belady_eviction(tmp_path, prefetch):
    """A model calling its blocks out of order: after the warm-up pass the cache fetches exactly
    Belady's minimum for the recorded accesses (fewer than LRU would), and stays bitwise plain."""
    import torch

    import tiertrain
    from tiered_harness import batches
    from tiertrain.train.objective import lm_loss
    from tiertrain.train.optimizer import make_adamw
    from tiertrain.models import GPT, resolve_config

    class Shared(GPT):
        def forward(self, idx, targets):
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
            for i in ORDER:
                x = self.blocks[i](x)
            logits = self.lm_head(self.ln_f(x))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def fresh():
        torch.manual_seed(0)
        model = Shared(resolve_config(TINY4))
        return model, make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)[0]

    def run(model, opt, after_step=lambda: None):
        losses = []
        for b in batches(5):
            loss = lm_loss(model, b[:, :-1], b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            after_step()
        return losses

    expected = run(*fresh())
    model, opt = fresh()
    plan = Plan(tuple(BlockPlan(stream=True) for _ in range(4)), window=2, prefetch=prefetch)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan=plan, page_size=64 * 1024)
    fetches = []
    try:
        got = run(tm, topt, lambda: fetches.append(tm.runtime.cache.pop_fetches()))
        trace, prefetched = tm.runtime.cache.trace, tm.runtime.cache.prefetched
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert got == expected
    forward = list(ORDER)
    assert trace == forward + forward[::-1]  # recorded: forward pre hooks, then backward pre hooks in reverse
    best = belady_misses(trace, 2)
    assert best < lru_misses(trace, 2)
    if prefetch == 0:
        assert fetches[1:] == [best] * 4
    else:  # a prefetch never costs an extra fetch
        assert all(f <= best for f in fetches[1:]) and prefetched >= 5


def test_transient_gradients_count_a_wide_embedding_once_not_once_per_worker(monkeypatch):
    """Overlap keeps at most ``update_workers + 1`` gradient chunks: the largest that many, not the
    largest times that many. With a wide vocabulary the rest block's chunk outweighs every block
    together; counted per worker, the few chunks needed more host than all of them. At the budget
    the check now asks, the run stays within it (updates slowed so that backward would outrun them)
    and its losses are plain PyTorch's."""
    import time

    import tiertrain
    import tiertrain.runtime.block_group as updater
    from tiered_harness import _fresh, _loop
    from tiertrain.plan import builtin_plan
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    slow = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.1), slow(*a)))
    wide = {**TINY4, "vocab_size": 8192}
    plan, page = builtin_plan("stream", 4, update="overlap"), 64 * 1024
    blocks = find_blocks(_fresh(wide)[0])
    numels = [sum(p.numel() for _, p in b.params) for b in blocks]
    assert numels[-1] > sum(numels[:-1])
    few, every = (needs(blocks, plan, page, transient_grads=t)[Tier.HOST] for t in (True, False))
    assert few < every
    model, opt = _fresh(wide)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=DEVICE_BUDGET, host=few), plan=plan, page_size=page)
    try:
        assert tm.runtime.bounded_grads
        assert _loop(tm, topt, tm.clip_grad_norm_, 3, 1, None) == train_plain(wide, 3, 1, None)
        assert tm.runtime.mem.stats()["host"]["pages_peak_bytes"] <= few
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_overlap_bounds_the_gradients_in_host_only_where_the_host_budget_needs_it(tmp_path, monkeypatch):
    """Overlap updates each block's gradients away as they come. Where the host budget holds them all,
    backward never waits for the optimizer; where it holds only a few, backward waits to stay in it
    (updates are slowed here so that backward would outrun them). Either way the losses are plain PyTorch's."""
    import time

    import tiertrain
    import tiertrain.runtime.block_group as updater

    slow = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.2), slow(*a)))
    from tiered_harness import _fresh, _loop
    from tiertrain.plan import builtin_plan
    from tiertrain.runtime.blocks import find_blocks
    from tiertrain.plan.fit import alive_grad_bytes
    from conftest import needs

    plan, page = builtin_plan("stream", 4, update="overlap"), 64 * 1024
    blocks = find_blocks(_fresh(TINY4)[0])
    few, every = (needs(blocks, plan, page, transient_grads=t)[Tier.HOST] for t in (True, False))
    assert few < every
    want = train_plain(TINY4, 4, 1, None)
    for host, bounded in ((every, False), (few, True)):
        model, opt = _fresh(TINY4)
        tm, topt = tiertrain.setup(model, opt, Budgets(device=DEVICE_BUDGET, host=host), plan=plan, page_size=page)
        try:
            assert tm.runtime.bounded_grads is bounded
            assert _loop(tm, topt, tm.clip_grad_norm_, 4, 1, None) == want
            stats = tm.runtime.mem.stats()["host"]
            assert stats["pages_peak_bytes"] <= host
            own = [st.nbytes for st in tm.runtime.groups]
            reserved = alive_grad_bytes(own, plan.update_workers, 1, 0)
            # bounded: never more grad chunks than the budget reserved (the blocks' and the rest's, whose chunk a
            # tied weight's head gradient fills from backward's start: runtime.tied), counting those an update
            # holds; else all at once
            assert (stats["peak_by_kind"]["grad"] <= reserved) is bounded
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_device_homed_blocks_keep_gradients_on_the_device_and_fp32_ones_update_their_slot_in_place(precision):
    """A device-homed block is updated on the device: its gradients gather there (on a GPU they
    would otherwise cross the link twice a step), and in fp32 its slot is its master, updated in
    place as plain PyTorch updates its parameters (no second copy, no copy after each update).
    A host-homed block's gradients go to the host. The device tier holds what the budget check counted."""
    import torch

    import tiertrain
    from tiered_harness import _fresh, batches
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Kind
    from tiertrain.plan import builtin_plan
    from tiertrain.runtime.blocks import find_blocks
    from conftest import needs

    page = 64 * 1024
    mixed = Plan((BlockPlan(home=Tier.DEVICE),) * 2 + (BlockPlan(home=Tier.HOST, stream=True),) * 2,
                 BlockPlan(home=Tier.DEVICE), compute_dtype=precision, name="mixed")
    for plan in (builtin_plan("resident", 4), mixed):
        plan = dataclasses.replace(plan, compute_dtype=precision)
        model, opt = _fresh(TINY4)
        need = needs(find_blocks(model), plan, page)
        tm, topt = tiertrain.setup(model, opt, Budgets(device=need[Tier.DEVICE], host=need[Tier.HOST]), plan=plan,
                                   page_size=page)
        rt, acc = tm.runtime, tm.runtime.mem.accounting
        try:
            x = batches(1)[0]
            lm_loss(tm, x[:, :-1], x[:, 1:]).backward()
            on_device = [st for st in rt.groups if st.plan.home is Tier.DEVICE]
            assert acc.chunks(Tier.DEVICE, Kind.GRAD) == len(on_device)
            assert acc.chunks(Tier.HOST, Kind.GRAD) == len(rt.groups) - len(on_device)
            topt.step()
            topt.zero_grad()
            for st in on_device:
                assert (st.master is st.slot.chunk) == (precision == "fp32")
                for p, m in zip(st.params, st.views(st.master)):  # the module computes with the new master
                    assert torch.equal(p.detach(), m.to(p.dtype))
            assert (acc.peak(Tier.DEVICE, Kind.MASTER) == 0) == (precision == "fp32")  # no second fp32 copy
            assert rt.mem.stats()["device"]["pages_peak_bytes"] <= need[Tier.DEVICE]
        finally:
            rt.close()
            rt.mem.close()

