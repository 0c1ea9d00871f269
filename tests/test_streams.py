"""STRONGHOLD's multi-stream execution inside one device (issue 40, deliverable 3), its CPU half: the order
in which a block's chunks are issued and joined (on a recording stand-in of CUDA streams), the chunks'
exactness (a tiered model over two streams trains as plain PyTorch running each block's batch as two
chunks, bit for bit; as the whole batch within fp32 rounding), the refusals, and the planner's choice
from measured times. On the GPU the same code issues the chunks on CUDA streams (scripts/gpu_check.sh)."""

import dataclasses

import pytest
import torch
from tiered_harness import TINY4, _fresh, _loop, batches

from tiertrain.errors import ConfigError
from tiertrain.memory import Budgets
from tiertrain.plan import builtin_plan
from tiertrain.runtime.streams import OneStream, in_streams


class Recorded:
    """A stand-in for CUDA streams that logs what each call asks of them."""

    def __init__(self, log: list) -> None:
        self.log = log

    def fork(self, i):
        self.log.append(("fork", i))

    def side(self, i):
        log = self.log

        class Side:
            def __enter__(self):
                log.append(("on", i))

            def __exit__(self, *exc):
                log.append(("off", i))
        return Side()

    def keep(self, t, i):
        self.log.append(("keep", i, tuple(t.shape)))

    def join(self, i):
        self.log.append(("join", i))


def test_each_chunk_is_issued_on_its_own_stream_after_the_steps_work_and_joined_before_its_outputs_are_used():
    log = []

    def forward(x, mask=None, rotary=None, position=None):
        log.append(("compute", tuple(x.shape), None if mask is None else tuple(mask.shape),
                    tuple(tuple(t.shape) for t in rotary), tuple(position.shape)))
        return x * 2, None

    x, mask = torch.arange(24.0).view(4, 3, 2), torch.ones(4, 1, 3, 3)
    per_row, shared = torch.ones(4, 3, 2), torch.ones(1, 3, 2)  # a table per row: split; one for all: whole
    out, none = in_streams(forward, 2, Recorded(log))(x, mask=mask, rotary=(per_row, shared),
                                                     position=torch.arange(4))  # 1-D: whole, though 4 = rows
    assert torch.equal(out, x * 2) and none is None
    chunk = [("compute", (2, 3, 2), (2, 1, 3, 3), ((2, 3, 2), (1, 3, 2)), (4,))]
    kept = [("keep", None, s) for s in ((2, 3, 2), (2, 1, 3, 3), (2, 3, 2), (1, 3, 2), (4,))]
    for i in (0, 1):
        assert log[i * 9:(i + 1) * 9] == [("fork", i), *[(k, i, s) for k, _, s in kept], ("on", i), *chunk, ("off", i)]
    assert log[18:] == [("join", 0), ("join", 1)]


def test_fewer_rows_than_streams_run_a_row_a_chunk_and_what_cannot_be_split_or_joined_is_refused():
    log = []
    out = in_streams(lambda x: x + 1, 4, Recorded(log))(torch.zeros(2, 3))  # an evaluation of two sequences
    assert torch.equal(out, torch.ones(2, 3)) and [e for e in log if e[0] == "join"] == [("join", 0), ("join", 1)]
    with pytest.raises(ConfigError, match="returned a dict"):
        in_streams(lambda x: {"h": x}, 2, OneStream())(torch.ones(2, 3))
    with pytest.raises(ConfigError, match="4 rows of 4 tokens and another argument of 4 along its first dimension"):
        in_streams(lambda x, mask: x, 2, OneStream())(torch.ones(4, 4, 8), mask=torch.ones(4, 4))  # (T, T)?

    class Cache:  # a transformers cache: each chunk would read the one before it as its past
        def __init__(self, held):
            self.held = held

        def get_seq_length(self):
            return self.held
    seen = []
    in_streams(lambda x, cache: seen.append(cache) or x, 2, OneStream())(torch.ones(2, 3, 1), cache=Cache(0))
    in_streams(lambda x, cache: seen.append(cache) or x, 2, OneStream())(torch.ones(2, 3, 1), Cache(0))  # GPT-2's
    assert seen == [None] * 4  # empty (a training forward): left out of the chunks' calls, by keyword or position
    with pytest.raises(ConfigError, match="key/value cache \\(cache\\) holding keys: generate on one stream"):
        in_streams(lambda x, cache: x, 2, OneStream())(torch.ones(2, 3, 1), cache=Cache(5))


def _streamed(plan, n):
    return dataclasses.replace(plan, blocks=tuple(dataclasses.replace(b, streams=n) for b in plan.blocks))


def _chunked_plain(steps):
    """Plain PyTorch, each block's forward over the batch as two chunks, concatenated."""
    model, opt = _fresh(TINY4)
    for block in model.blocks:
        own = block.forward
        block.forward = lambda x, f=own: torch.cat([f(c) for c in torch.tensor_split(x, 2)])
    return _loop(model, opt, None, steps, 1, None)


@pytest.mark.parametrize("plan", ["stream", "resident"])
def test_a_tiered_model_over_two_streams_trains_as_plain_pytorch_with_each_blocks_batch_in_two_chunks(tmp_path, plan):
    """Bit for bit against each block's two chunks one after the other; within fp32 rounding of the whole
    batch (its matmuls sum the rows in other blocks); with recompute and offloaded stashes per chunk too."""
    import tiertrain

    base = builtin_plan(plan, TINY4["n_layer"])
    stash = dataclasses.replace(base, blocks=tuple(dataclasses.replace(b, recompute=True, offload_hidden=True)
                                                   for b in base.blocks))
    want = _chunked_plain(3)
    model, opt = _fresh(TINY4)
    whole = _loop(model, opt, None, 3, 1, None)
    for p in (base, stash):
        model, opt = _fresh(TINY4)
        tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=_streamed(p, 2), page_size=64 << 10)
        try:
            assert all(g.plan.streams == 2 for g in tm.runtime.groups[:-1])
            got = _loop(tm, topt, None, 3, 1, None)
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()
        assert got == want, (p.name, got, want)
    assert whole == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_transformers_model_over_two_streams_trains_as_over_one(tmp_path, family):
    """Llama's decoder layers take the mask, positions and rotary tables as keywords (a tuple of tensors among
    them), and its empty key/value cache; GPT-2's blocks take the cache by position: each split by rows where
    it has them, shared ones whole, the cache left out; the same losses as one stream within fp32 rounding."""
    transformers = pytest.importorskip("transformers")
    import tiertrain

    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)

    def run(n):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20),
                                   plan=_streamed(builtin_plan("stream", 2), n), page_size=64 << 10)
        try:
            return _loop(tm, topt, None, 3, 1, None)
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()
    assert run(2) == pytest.approx(run(1), rel=1e-5)


def test_a_block_holding_experts_is_refused_over_streams():
    import tiertrain
    from tiertrain.models import build

    cfg = {**TINY4, "n_experts": 4}
    model = build(cfg)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="holds experts.*one stream"):
        tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=_streamed(builtin_plan("stream", 4), 2))


def _profile(ratio):
    from test_planner import synthetic

    prof = synthetic(6)
    return dataclasses.replace(prof, blocks=tuple(dataclasses.replace(b, stream_ratio=ratio) for b in prof.blocks))


def test_the_simulator_replays_blocks_over_streams_at_their_measured_times():
    from tiertrain.planner.simulator import simulate
    from tiertrain.planner.streams import with_streams

    plan = builtin_plan("resident", 6)
    prof = _profile(((2, 0.6), (4, 0.9)))
    one, two, four = (simulate(with_streams(plan, n), prof).step_s for n in (1, 2, 4))
    compute = sum(b.forward_s + b.backward_s for b in prof.blocks)
    assert one - two == pytest.approx(0.4 * compute, rel=1e-6) and one - four == pytest.approx(0.1 * compute, rel=1e-6)
    assert simulate(with_streams(plan, 2), _profile(())).step_s == one  # not measured: one stream's times


@pytest.mark.parametrize("ratio, want", [(((2, 0.7), (4, 0.8)), 2), (((2, 0.99), (4, 0.97)), 1), ((), 1)])
def test_the_planner_runs_blocks_over_streams_only_where_the_simulator_shows_a_gain(ratio, want):
    """Measured faster by 30% over two streams: chosen; by 1-3% (within GAIN): one stream; a CPU's
    profile (none measured): one stream."""
    from test_planner import problem

    from tiertrain.planner.auto import choose

    chosen, _ = choose(problem(_profile(ratio), 1 << 30), update="sync")
    assert {b.streams for b in chosen.plan.blocks} == {want}, chosen.plan
    overlap, _ = choose(problem(_profile(ratio), 1 << 30), update="overlap")  # updates on workers: never
    assert {b.streams for b in overlap.plan.blocks} == {1}


@pytest.mark.parametrize("update", ["overlap", "lockfree"])
def test_blocks_over_streams_with_updates_on_workers_are_refused_before_anything_is_allocated(update):
    import tiertrain

    model, opt = _fresh(TINY4)
    with pytest.raises(ConfigError, match=f"run with update 'sync', not '{update}'"):
        tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), update=update,
                        plan=_streamed(builtin_plan("stream", TINY4["n_layer"]), 2))


def test_the_profiler_times_each_block_over_each_stream_count_its_batch_allows():
    """On a CPU with a stand-in for CUDA streams (the chunks in turn): every block measured at 2 streams,
    none at 4 (the batch has 2 rows); each a positive fraction of its one-stream time."""
    from tiertrain.measure.model import _BlockTimer, _stream_ratios
    from tiertrain.models import build
    from tiertrain.runtime.blocks import find_blocks
    from tiertrain.train.objective import lm_loss

    model = build(TINY4)
    blocks = find_blocks(model)[:-1]
    timer = _BlockTimer(blocks, {p.untyped_storage().data_ptr() for p in model.parameters()}, lambda: None)
    handles = timer.attach()
    b = batches(1)[0][:2]

    def step():
        lm_loss(model, b[:, :-1], b[:, 1:]).backward()
    try:
        step()
        fwd, bwd = [t[-1] for t in timer.fwd], [t[-1] for t in timer.bwd]
        got = _stream_ratios(timer, step, 2, lambda: None, fwd, bwd, make=lambda n, device: OneStream())
    finally:
        for h in handles:
            h.remove()
    assert len(got) == len(blocks) and all(len(r) == 1 and r[0][0] == 2 and r[0][1] > 0 for r in got), got
    assert all("forward" not in vars(blk.module) for blk in blocks)  # each block's own forward again
