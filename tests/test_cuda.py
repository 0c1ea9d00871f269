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
