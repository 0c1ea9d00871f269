import random

import pytest

from tiered_harness import HF_GPT2, TINY4, train_plain, train_tiered
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, Tier
from tiertrain.runtime.budget_check import PlanDoesNotFit
from tiertrain.runtime.plan import BlockPlan, Plan

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
    blocks = tuple(BlockPlan(home=rng.choice(list(Tier)), stream=rng.random() < 0.5, recompute=rng.random() < 0.5,
                             param_copy=rng.random() < 0.5) for _ in range(n_blocks))
    window = rng.randint(1, 3)
    return Plan(blocks, BlockPlan(home=rng.choice(list(Tier))), window=window, prefetch=rng.randint(0, window - 1),
                update=rng.choice(["sync", "overlap"]), name="random")


PLANS = [random_plan(random.Random(seed), 4) for seed in range(50)]


def test_the_random_plans_cover_every_switch_and_tier_combination():
    seen = {(b.home, b.stream, b.recompute) for p in PLANS for b in p.blocks}
    assert len(seen) == len(Tier) * 2 * 2
    assert {(b.home, b.stream, b.param_copy) for p in PLANS for b in p.blocks if b.home is Tier.DISK} == {
        (Tier.DISK, s, c) for s in (True, False) for c in (True, False)}
    assert {p.update for p in PLANS} == {"sync", "overlap"}
    assert {p.window for p in PLANS} == {1, 2, 3} and {p.rest.home for p in PLANS} == set(Tier)


@pytest.mark.parametrize("seed", range(50))
def test_random_valid_plans_equal_plain_pytorch_bitwise(tmp_path, references, seed):
    plan = PLANS[seed]
    accum, clip = [(1, None), (2, None), (1, 0.5), (3, 0.5)][seed % 4]
    got, stats = train_tiered(TINY4, STEPS, accum, clip, plan, budgets(tmp_path))
    assert got == references(TINY4, accum, clip), plan.to_json()
    assert stats["device"]["peak"] <= DEVICE_BUDGET and stats["device"]["pages_in_use_bytes"] <= DEVICE_BUDGET


def test_plan_json_round_trips():
    for plan in PLANS[:5]:
        assert Plan.from_json(plan.to_json()) == plan


def test_a_plan_that_cannot_fit_is_refused_with_the_smallest_budgets(tmp_path):
    tiny = Budgets(device=64 * 1024, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "d"))
    with pytest.raises(PlanDoesNotFit, match=r"plan 'resident' does not fit: device needs .* Smallest budgets"
                                             r" for this plan: device .*with plan 'max-offload'"):
        train_tiered("tiny", 1, 1, None, "resident", tiny)
    assert not (tmp_path / "d").exists()  # refused before anything was allocated


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
    from tiered_harness import batches
    from tiertrain.models import build

    model = build(TINY4, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tm, topt = tiertrain.setup(model, opt, budgets(tmp_path), plan="max-offload", page_size=64 * 1024)
    try:
        ln = tm.module.blocks[0].ln1
        assert not ln.weight.is_meta and torch.equal(ln.weight, torch.ones_like(ln.weight))
        assert torch.equal(ln.bias, torch.zeros_like(ln.bias))
        w = tm.module.blocks[3].attn.qkv.weight
        assert 0.015 < float(w.detach().std()) < 0.025  # N(0, 0.02)
        losses = []
        for b in batches(1) * 6:  # one batch, again and again: the loss must fall
            loss = tm(b[:, :-1], b[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


@pytest.mark.parametrize("plan,update", [("resident", "sync"), ("max-offload", "overlap")])
def test_fp16_overflow_skips_the_step_and_backs_off_as_gradscaler_does(tmp_path, plan, update):
    """A scale of 2**24 overflows fp16 gradients: the step is skipped (weights and AdamW step
    counts untouched), the scale halves, and training resumes once it fits; plain PyTorch's
    autocast + GradScaler from the same scale skips as many steps."""
    import torch

    import tiertrain
    from tiered_harness import _fresh, batches
    from tiertrain.engine.objective import lm_loss
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
