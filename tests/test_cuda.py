"""The CUDA half of the runtime's checks. Skipped where no GPU is visible (CI has none);
``scripts/gpu_check.sh`` runs them on a GPU machine together with the GPU benchmarks.

On a GPU the tiered run and the plain one are not bit-for-bit alike by construction: the plain
run updates with torch's fused CUDA AdamW, a host-homed tiered block with the fused CPU one, and
the two kernels round differently. Device-homed (resident) blocks run the same CUDA kernels as
plain PyTorch. So the losses are compared within a tolerance, and tighter for ``resident``.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from tiered_harness import TINY4, train_plain, train_tiered
from tiertrain.memory import Budgets, Tier
from tiertrain.plan import BlockPlan, Plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a GPU machine)")

STEPS = 10
DEVICE_BUDGET = 8 << 20


def _budgets(tmp_path) -> Budgets:
    return Budgets(device=DEVICE_BUDGET, host=64 << 20, disk=64 << 20, disk_dir=str(tmp_path / "disk"))


def _close(got: list[float], want: list[float], rtol: float) -> None:
    assert all(g == g for g in got), f"NaN in the tiered losses: {got}"
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= rtol, f"losses differ by up to {worst:.2e} (limit {rtol:.0e}): {got} against {want}"


@pytest.fixture(scope="module")
def plain_cuda():
    return {(a, c): train_plain(TINY4, STEPS, a, c, device="cuda") for a, c in ((1, None), (2, 0.5))}


@pytest.mark.parametrize("plan,rtol", [("resident", 1e-6), ("stream", 1e-4), ("max-offload", 1e-4)])
@pytest.mark.parametrize("update", ["sync", "overlap"])
@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.5)])
def test_builtin_plans_on_cuda_follow_plain_pytorch_on_cuda(tmp_path, plain_cuda, plan, rtol, update, accum, clip):
    got, stats = train_tiered(TINY4, STEPS, accum, clip, plan, _budgets(tmp_path), update=update, device="cuda")
    _close(got, plain_cuda[(accum, clip)], rtol)
    assert stats["device"]["peak"] <= DEVICE_BUDGET


def test_every_switch_on_cuda_follows_plain_pytorch(tmp_path, plain_cuda):
    """Streaming with prefetch and a cache, recompute, the hidden state stashed on the (pinned)
    host and brought back on the copy streams, and states in all three tiers, in one plan."""
    blocks = (BlockPlan(home=Tier.DEVICE, offload_hidden=True), BlockPlan(home=Tier.HOST, stream=True, recompute=True),
              BlockPlan(home=Tier.DISK, stream=True, offload_hidden=True), BlockPlan(home=Tier.HOST, stream=True))
    plan = Plan(blocks, BlockPlan(home=Tier.HOST), window=2, cache=1, prefetch=1, update="overlap", name="all")
    got, _ = train_tiered(TINY4, STEPS, 1, None, plan, _budgets(tmp_path), device="cuda")
    _close(got, plain_cuda[(1, None)], 1e-4)


def test_the_pools_are_on_the_gpu_and_the_host_pool_is_pinned(tmp_path):
    import tiertrain
    from tiered_harness import _fresh

    model, opt = _fresh(TINY4)
    tm, _ = tiertrain.setup(model, opt, _budgets(tmp_path), plan="stream", page_size=64 * 1024)
    try:
        assert tm.runtime.mem.pool(Tier.DEVICE).buffer.is_cuda
        assert tm.runtime.mem.pool(Tier.HOST).pinned
        assert all(p.is_cuda for p in model.parameters())
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


@pytest.mark.parametrize("plan", ["stream", "auto"])
def test_train_on_cuda_with_a_plan_writes_device_peaks(tmp_path, plan):
    r = run_cli("train", "--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--plan", plan,
                "--device", "cuda", "--device-memory", "256MiB", "--host-memory", "1GiB", "--out", str(tmp_path / "run"),
                timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["loss"] == row["loss"] for row in rows)
    assert 0 < rows[-1]["peak_bytes"]["device"]


def test_a_meta_built_model_is_planned_from_one_block_run_on_the_gpu_in_bf16(tmp_path, monkeypatch):
    """``plan auto`` on a model it cannot run plain measures one block on the GPU, in the run's
    precision: every block saves what profiling the real model there in bf16 finds, byte for byte."""
    import tiertrain
    from tiertrain.train.objective import lm_loss
    from tiertrain.measure.model import measure_profile
    from tiertrain.models import ModelConfig, build
    from tiertrain.runtime.blocks import find_blocks

    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=256, d_ffn=1024, vocab_size=256, max_seq_len=128, name="t")
    model = build(cfg, device="meta")
    step = lambda: None  # noqa: E731 - a meta model never runs its profile step
    step.shape = (2, 64)
    tm, _ = tiertrain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _budgets(tmp_path), plan="auto",
                            profile_step=step, compute_dtype="bf16", page_size=64 << 10)
    try:
        got = tm.auto_plan.profile
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert got.key.endswith("/one-block") and got.compute_bytes == 2
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in got.blocks)
    real = build(cfg).cuda()
    x = torch.randint(0, 256, (2, 65), device="cuda")

    def plain() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(real, x[:, :-1], x[:, 1:])
        loss.backward()

    want = measure_profile(real, find_blocks(real), plain, got.machine, "bf16", "k", 64 << 10)
    assert [b.act_bytes for b in got.blocks] == [b.act_bytes for b in want.blocks]


def test_a_fresh_process_measures_one_block_of_a_large_model_within_five_seconds_on_the_gpu(tmp_path):
    """The first pass on a GPU pays CUDA's lazy set-up: timed, it read a 64M-param block (gpu-1.5b's)
    as 16,000x its roofline on an H200, so no shape fitted 5 s and the plan fell back to the analytic
    profile. In a fresh process, as ``train --plan auto`` runs it, the block is measured."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from tiertrain.measure.bounds import MeasureBounds
        from tiertrain.measure.machine import probe
        from tiertrain.measure.one_block import profile_one_block
        from tiertrain.models import ModelConfig, build
        from tiertrain.runtime.blocks import find_blocks
        cfg = ModelConfig(n_layer=4, n_head=18, d_model=2304, d_ffn=9216, vocab_size=256, max_seq_len=1024, name="w")
        model = build(cfg, device="meta")
        got = profile_one_block(model, find_blocks(model), cfg, (4, 1024), "bf16", torch.device("cuda"), probe(),
                                "k", MeasureBounds(40 << 30, 5.0))
        print("HOW", got.source)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TIERTRAIN_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0 and "HOW" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("plan_name", ["resident", "stream"])
def test_blocks_over_two_cuda_streams_train_as_their_chunks_on_one_stream_bit_for_bit(tmp_path, plan_name):
    """STRONGHOLD's multi-stream execution on the GPU: each block's two chunks issued on two CUDA streams give
    the bits of the same two chunks issued on the step's stream (``runtime.streams``)."""
    from tiertrain.bench.streams import one_stream
    from tiertrain.plan import builtin_plan
    from tiertrain.planner.streams import with_streams

    plan = with_streams(builtin_plan(plan_name, TINY4["n_layer"]), 2)
    got, _ = train_tiered(TINY4, STEPS, 1, None, plan, _budgets(tmp_path / "two"), device="cuda")
    with one_stream():
        want, _ = train_tiered(TINY4, STEPS, 1, None, plan, _budgets(tmp_path / "one"), device="cuda")
    assert got == want
