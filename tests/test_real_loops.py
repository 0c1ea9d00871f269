"""Loops users already have run unchanged on a tiered model (issue 18): the model object itself,
a real torch Optimizer that schedulers drive, torch's clip_grad_norm_, evaluation and generate,
state dicts both ways, save_pretrained/from_pretrained, budgets from the machine, small models
in small budgets. Everything bitwise against plain PyTorch on CPU in fp32."""

import math

import pytest
import torch

import tiertrain
from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets, Tier
from tiertrain.models import build
from tiertrain.plan import BlockPlan, Plan, builtin_plan

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
OURS = {"n_layer": 3, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256, "max_seq_len": 64}
MODELS = {"llama": LLAMA, "gpt2": GPT2, "ours": OURS}
PAGE = 64 << 10


def _fresh(spec):
    torch.manual_seed(0)
    model = build(spec)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), fused=True)
    return model, opt


def _loss(model, x, y):
    out = model(x, y) if isinstance(model, tiertrain.models.GPT) else model(input_ids=x, labels=y)
    return out if isinstance(out, torch.Tensor) else out.loss


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (2, 17), generator=g) for _ in range(n)]


def no_trainer_loop(model, opt, steps: int, accum: int) -> dict:
    """transformers' no_trainer examples, in short: get_scheduler, clip over model.parameters(),
    zero_grad(set_to_none=True), an evaluation pass under no_grad, then generate."""
    from transformers import get_scheduler

    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=1, num_training_steps=steps)
    data, losses, norms = _batches(steps * accum), [], []
    model.train()
    for s in range(steps):
        for a in range(accum):
            b = data[s * accum + a]
            loss = _loss(model, b, b) / accum
            loss.backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        held = _batches(1, seed=7)[0]
        eval_loss = _loss(model, held, held).item()
    prompt = held[:, :5]
    if isinstance(model, tiertrain.models.GPT):
        generated = model.generate(prompt, max_new_tokens=4)
    else:
        generated = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                   do_sample=False, pad_token_id=0)
    return {"losses": losses, "norms": norms, "eval": eval_loss, "generated": generated.tolist(),
            "lr": [g["lr"] for g in opt.param_groups]}


_PLAIN: dict = {}


def _plain(name: str, steps: int, accum: int) -> dict:
    key = (name, steps, accum)
    if key not in _PLAIN:
        _PLAIN[key] = no_trainer_loop(*_fresh(MODELS[name]), steps, accum)
    return _PLAIN[key]


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("update", ["sync", "overlap"])
@pytest.mark.parametrize("plan", ["resident", "stream", "max-offload"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "ours"])
def test_a_no_trainer_loop_runs_unchanged_and_bitwise(tmp_path, name, plan, update, accum):
    model, opt = _fresh(MODELS[name])
    budgets = Budgets(device=64 << 20, host=64 << 20, disk=64 << 20 if plan == "max-offload" else 0,
                      disk_dir=str(tmp_path / "disk") if plan == "max-offload" else None)
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, update=update, grad_accum=accum, max_grad_norm=1.0,
                               page_size=PAGE)
    try:
        assert tm is model and isinstance(topt, torch.optim.Optimizer)
        got = no_trainer_loop(tm, topt, 4, accum)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    want = _plain(name, 4, accum)
    assert got == want
    assert all(n > 0 for n in got["norms"])  # never a silent 0


def test_the_model_keeps_every_attribute_and_moves_only_where_it_is(tmp_path):
    from transformers import PreTrainedModel

    model, opt = _fresh(LLAMA)
    cls = type(model)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=PAGE)
    try:
        assert isinstance(tm, cls) and isinstance(tm, PreTrainedModel) and type(tm).__name__ == cls.__name__
        assert tm.config.hidden_size == 48 and tm.to("cpu") is tm and tm.float() is tm
        with pytest.raises(ConfigError, match="cannot be moved"):
            tm.half()
        with pytest.raises(ConfigError, match="already set up"):
            tiertrain.setup(tm, topt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=PAGE)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_state_dicts_gather_the_current_weights_and_load_them_where_they_live(tmp_path):
    plain, popt = _fresh(OURS)
    model, opt = _fresh(OURS)
    budgets = Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path / "disk"))
    tm, topt = tiertrain.setup(model, opt, budgets, plan="max-offload", page_size=PAGE)
    try:
        for b in _batches(3):
            for m, o in ((plain, popt), (tm, topt)):
                _loss(m, b, b).backward()
                o.step()
                o.zero_grad()
        got, want = tm.state_dict(), plain.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        fresh, _ = _fresh(OURS)
        assert tm.load_state_dict(fresh.state_dict()).missing_keys == []
        assert all(torch.equal(tm.state_dict()[k], v) for k, v in fresh.state_dict().items())
        # the moments are kept: torch's optimizer state dict still holds the three steps'
        assert all(float(s["step"]) == 3 for s in topt.state_dict()["state"].values())
        with pytest.raises(RuntimeError, match="missing keys"):
            tm.load_state_dict({})
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_save_pretrained_writes_the_trained_weights_that_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    model, opt = _fresh(LLAMA)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=PAGE)
    try:
        for b in _batches(2):
            _loss(tm, b, b).backward()
            topt.step()
            topt.zero_grad()
        tm.save_pretrained(tmp_path / "saved")
        trained = tm.state_dict()
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    untouched, _ = _fresh(LLAMA)
    assert not all(torch.equal(v, untouched.state_dict()[k]) for k, v in loaded.state_dict().items())


SCHEDULERS = [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=4),
    lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
]


@pytest.mark.parametrize("make", SCHEDULERS)
def test_torch_lr_schedulers_drive_the_tiered_optimizer_as_plain_adamw(tmp_path, make):
    def run(model, opt):
        sched, losses = make(opt), []
        for b in _batches(3):
            loss = _loss(model, b, b)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [g["lr"] for g in opt.param_groups]

    want = run(*_fresh(OURS))
    model, opt = _fresh(OURS)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=PAGE)
    try:
        assert run(tm, topt) == want
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_the_optimizer_state_dict_is_torchs_and_resumes_bitwise(tmp_path, monkeypatch):
    data = _batches(4)

    def train(model, opt, batches):
        out = []
        for b in batches:
            loss = _loss(model, b, b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    plain, popt = _fresh(OURS)
    want = train(plain, popt, data)
    model, opt = _fresh(OURS)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=PAGE)
    first = train(tm, topt, data[:2])
    sd, weights = topt.state_dict(), tm.state_dict()
    ref = _fresh(OURS)
    ref_model, ref_opt = ref
    train(ref_model, ref_opt, data[:2])
    want_sd = ref_opt.state_dict()
    assert sd["param_groups"] == want_sd["param_groups"]
    assert sd["state"].keys() == want_sd["state"].keys()
    assert all(torch.equal(sd["state"][i][k], want_sd["state"][i][k]) for i in sd["state"] for k in sd["state"][i])
    tm.runtime.close()
    tm.runtime.mem.close()
    model2, opt2 = _fresh(OURS)
    tm2, topt2 = tiertrain.setup(model2, opt2, Budgets(64 << 20, 64 << 20), plan="max-offload", page_size=PAGE)
    try:
        tm2.load_state_dict(weights)
        topt2.load_state_dict(sd)
        assert first + train(tm2, topt2, data[2:]) == want
        import tiertrain.api.tiered_optimizer as tiered_optimizer

        monkeypatch.setattr(tiered_optimizer, "host_available", lambda: 1024)
        with pytest.raises(tiered_optimizer.StatesTooLarge, match="tiertrain's checkpoints"):
            topt2.state_dict()
    finally:
        tm2.runtime.close()
        tm2.runtime.mem.close()


def test_clipping_over_model_parameters_in_every_mode_that_can_and_a_clear_error_where_it_cannot(tmp_path):
    b = _batches(1)[0]
    plain, _ = _fresh(OURS)
    _loss(plain, b, b).backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    for update in ("sync", "overlap"):
        model, opt = _fresh(OURS)
        tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", update=update,
                                   max_grad_norm=0.5, page_size=PAGE)
        try:
            _loss(tm, b, b).backward()
            assert torch.equal(torch.nn.utils.clip_grad_norm_(tm.parameters(), 0.5), want)
            with pytest.raises(ConfigError, match="all of its parameters"):
                torch.nn.utils.clip_grad_norm_(list(tm.parameters())[:3], 0.5)
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()
    model, opt = _fresh(OURS)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", update="lockfree",
                               page_size=PAGE)
    try:
        _loss(tm, b, b).backward()
        with pytest.raises(ConfigError, match="lockfree"):
            torch.nn.utils.clip_grad_norm_(tm.parameters(), 0.5)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    other, _ = _fresh(OURS)  # another model's parameters still go to torch's own function
    _loss(other, b, b).backward()
    assert torch.equal(torch.nn.utils.clip_grad_norm_(other.parameters(), 0.5), want)


def test_clipping_declared_at_setup_applies_in_sync_mode_without_a_call(tmp_path):
    def run(model, opt, call: bool):
        losses = []
        for b in _batches(3):
            loss = _loss(model, b, b)
            loss.backward()
            if call:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    want = run(*_fresh(OURS), call=True)
    model, opt = _fresh(OURS)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", update="sync",
                               max_grad_norm=0.05, page_size=PAGE)
    try:
        assert run(tm, topt, call=False) == want
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_a_small_llama_trains_within_small_budgets_with_a_measured_page_size(tmp_path):
    model, opt = _fresh(LLAMA)
    n = sum(p.numel() for p in model.parameters())
    assert 90_000 <= n <= 130_000
    tm, topt = tiertrain.setup(model, opt, Budgets(device=8 << 20, host=64 << 20), plan="max-offload")
    try:
        losses = []
        for b in _batches(3):
            loss = _loss(tm, b, b)
            loss.backward()
            topt.step()
            topt.zero_grad()
            losses.append(loss.item())
        stats = tm.runtime.mem.stats()
        assert stats["device"]["pages_peak_bytes"] <= 8 << 20 and stats["host"]["pages_peak_bytes"] <= 64 << 20
        assert tm.runtime.mem.page_size <= 64 << 10 and all(math.isfinite(v) for v in losses)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_without_budgets_setup_takes_them_from_the_machine_and_says_so(tmp_path, capsys):
    model, opt = _fresh(OURS)
    plan = builtin_plan("stream", 3)
    tm, topt = tiertrain.setup(model, opt, plan=plan, page_size=PAGE)
    try:
        err = capsys.readouterr().err
        assert "budgets: device" in err and "taken from the machine" in err and "no disk" in err
        b = _batches(1)[0]
        _loss(tm, b, b).backward()
        topt.step()
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


@pytest.mark.parametrize("update,accum", [("sync", 1), ("overlap", 2)])
@pytest.mark.parametrize("name", ["llama", "gpt2", "ours"])
def test_plan_auto_without_a_profile_function_plans_from_the_first_step_and_stays_bitwise(tmp_path, capsys, name,
                                                                                          update, accum):
    """The loop's first step runs under max-offload and is the profile; the chosen plan takes over at
    the step boundary (states moved between tiers), and the losses are plain PyTorch's bitwise."""
    model, opt = _fresh(MODELS[name])
    budgets = Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path / "disk"))
    tm, topt = tiertrain.setup(model, opt, budgets, update=update, grad_accum=accum, max_grad_norm=1.0,
                               page_size=PAGE)
    seen, rt = [], tm.runtime
    at_setup = {g.states[0].tier for g in rt.groups}
    topt.register_step_pre_hook(lambda *_: seen.append(rt.plan.name))  # the plan each step ran under
    try:
        got = no_trainer_loop(tm, topt, 4, accum)
        first = tiertrain.autoplan.first_step.first_plan(len(rt.groups) - 1, True, update)
        assert seen[0] == "max-offload" and at_setup == {bp.home for bp in (*first.blocks, first.rest)}
        assert tm.auto_plan is not None and rt.plan == tm.auto_plan.plan and rt.plan.blocks != first.blocks
        assert seen[1:] == [rt.plan.name] * 3
        assert {g.states[0].tier for g in rt.groups} == {bp.home for bp in (*rt.plan.blocks, rt.plan.rest)}
        assert Tier.DISK not in {g.states[0].tier for g in rt.groups}  # 64 MiB of each: nothing needs the disk
        assert "after the first step, auto plan" in capsys.readouterr().err
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert got == _plain(name, 4, accum)


def test_plan_auto_without_a_profile_function_is_refused_where_it_cannot_replan(tmp_path):
    model, _ = _fresh(OURS)
    with pytest.raises(ConfigError, match="forward-only run.*profile_step"):
        tiertrain.setup(model, None, Budgets(64 << 20, 64 << 20), train=False, page_size=PAGE)
    model, opt = _fresh(OURS)
    with pytest.raises(tiertrain.plan.fit.PlanDoesNotFit, match="first step under 'max-offload'"):
        tiertrain.setup(model, opt, Budgets(1 << 10, 1 << 10), page_size=PAGE)
