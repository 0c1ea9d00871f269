"""Pipelined training over tiered stages (issue 38): pp = 2 and pp = 2 x dp = 2 gloo ranks, every schedule,
a host-homed and a disk-homed plan, train as one process of plain PyTorch accumulating the same
micro-batches, bit for bit in fp32 (a stage computes the model's own ops in its order, the activations and
their gradients cross between stages unchanged, and a dp = 2 reduction is a sum of two, which any order
gives alike); with clipping within a stated tolerance. AIAO's per-segment DP.sync is checked on recorded
events."""

import functools
import math

import pytest
import torch

from dp_harness import run_ranks
from pp_harness import (Case, meta_built, pipelined_losses, reference, resumed_from_one_process, segment_inbox,
                        stashed_checkpoints, tiered_reference)

# bf16 stages against one tiered process in bf16 (plain PyTorch under autocast keeps fp32 embeddings): the
# same ops on the same bf16 weights, so bit for bit too
BF16 = [Case("1f1b", 4, 1, dtype="bf16"), Case("aiao", 4, 2, dtype="bf16"), Case("aiao", 4, 2, plan="disk", dtype="bf16")]
# A tied embedding across the first and last stage: each stage sums its micro-batches' gradients of it before
# the two are added, where one process adds the head's and the embedding's per micro-batch (and over two
# replicas each stage averages its side first): the same terms in another order, a few ulps apart (the losses
# here differ by at most 2 ulps, 1.7e-7 relative); one micro-batch over one replica adds the same two terms,
# bit for bit. Checked within TIED_RTOL, five times the largest seen and a thousand below any real fault.
TIED = [Case("gpipe", 1, 1, tied=True), Case("1f1b", 4, 1, tied=True), Case("aiao", 4, 2, tied=True),
        Case("aiao", 4, 2, plan="disk", tied=True), Case("aiao", 4, 2, clip=0.05, tied=True)]
TIED_RTOL = 1e-6
# transformers causal LMs cut into stages (their base model's own forward over each stage's layers; GPT-2's
# position embeddings on the first stage alone, GPT-NeoX's partial rotary)
LLAMA = [Case("1f1b", 4, 1, family="llama"), Case("aiao", 4, 2, plan="disk", family="llama"),
         Case("aiao", 4, 2, tied=True, family="llama"), Case("aiao", 4, 2, plan="stash", family="llama"),
         Case("1f1b", 4, 1, family="qwen2"), Case("aiao", 4, 2, family="mistral"),
         Case("aiao", 4, 2, tied=True, family="gpt2"), Case("1f1b", 4, 1, plan="disk", family="gpt2"),
         Case("aiao", 4, 2, plan="stash", family="gpt_neox"), Case("1f1b", 4, 1, tied=True, family="gpt_neox")]
# a mixture of experts: each block's load-balancing loss, which the whole model adds to its loss, weighed in by
# the stage holding the block (its gradient where the block's output leaves) and added to each micro-batch's loss
# once the step is over; over replicas too (each block's experts reduced when backward ends, as data parallel
# does), and with the experts divided over the replicas (expert parallel: an expert sums its gradients over
# both replicas' micro-batches in their order, not replica by replica: CLIP_RTOL)
MOE = [Case("1f1b", 2, 1, clip=0.05, family="moe"), Case("aiao", 4, 2, plan="stash", family="moe"),
       Case("interleaved", 4, 2, plan="disk", family="moe")]
MOE_DP2 = [Case("gpipe", 2, 1, plan="disk", family="moe"), Case("aiao", 4, 2, clip=0.05, family="moe", ep=2)]
MOE_SAVED = Case("1f1b", 2, 1, plan="disk", family="moe", ep=2)
SCHEDULES = [Case("gpipe", 2, 1), Case("1f1b", 4, 1), Case("interleaved", 4, 2), Case("aiao", 4, 2)]
PP2 = SCHEDULES + [Case(c.schedule, c.micro, c.segments, plan="disk") for c in SCHEDULES] + [
    Case("aiao", 4, 2, update="overlap"), Case("aiao", 4, 2, clip=0.05), Case("1f1b", 4, 1, clip=0.05),
    Case("aiao", 4, 2, plan="stash"), Case("1f1b", 4, 1, plan="stash")] + BF16 + TIED + LLAMA + MOE
PP2_DP2 = SCHEDULES + [Case("aiao", 4, 2, plan="disk"), Case("aiao", 4, 2, update="overlap"),
                       Case("aiao", 4, 2, clip=0.05), Case("aiao", 4, 2, tied=True),
                       Case("aiao", 4, 2, clip=0.05, tied=True), Case("aiao", 4, 2, family="llama")] + MOE_DP2
# Clipping: the pipeline's norm combines each stage's (sqrt of a sum of squares of per-stage norms) where torch
# takes one norm over every parameter's: the same value within fp32 rounding of a few ulps, so the clipped
# steps may differ in the last bits; 1e-6 relative is a hundred times that and a thousand below any real fault.
CLIP_RTOL = 1e-6


def _jobs(cases, pp, tmp, events):
    jobs = [((case,), functools.partial(pipelined_losses, case=case, pp=pp, disk=tmp / f"{i}")) for i, case in
            enumerate(cases)]
    return jobs + [(("events",), functools.partial(pipelined_losses, case=events, pp=pp, disk=tmp / "events",
                                                   events=True))]


SAVED, RESUMED = Case("1f1b", 4, 1), Case("aiao", 4, 2)  # the resumed run cuts the model into 4 stages, not 2
LLAMA_SAVED = Case("1f1b", 4, 1, family="llama")
TIED_SAVED, TIED_RESUMED = Case("gpipe", 1, 1, tied=True), Case("aiao", 1, 2, tied=True)  # one micro-batch: exact


def _checkpoint_jobs(pp, disk, out, resume: bool):
    """A run saving after its first step into ``out``; with ``resume``, one going on from that checkpoint
    with another cut of the model (the jobs run in turn on every rank)."""
    jobs = [(("saved",), functools.partial(pipelined_losses, case=SAVED, pp=pp, disk=disk / "saved", save_to=out))]
    return jobs + ([(("resumed",), functools.partial(pipelined_losses, case=RESUMED, pp=pp, disk=disk / "resumed",
                                                      load_from=out))] if resume else [])


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    disk = tmp_path_factory.mktemp("pp2d")
    jobs = _jobs(PP2, 2, disk, Case("aiao", 4, 2))
    jobs += [(("stash", m), functools.partial(stashed_checkpoints, micro=m)) for m in (4, 8)]
    jobs += [(("inbox", 4), functools.partial(segment_inbox, micro=4)),
             (("inbox full", 4), functools.partial(segment_inbox, micro=4, host=0))]
    out = tmp_path_factory.mktemp("pp2run")
    jobs += _checkpoint_jobs(2, disk, out, resume=True)
    jobs += [(("from one",), functools.partial(resumed_from_one_process, pp=2, disk=disk / "one",
                                               out=tmp_path_factory.mktemp("one")))]
    tied_out = tmp_path_factory.mktemp("pp2tied")  # a tied run saved by 2 stages, resumed by 4; and from one process
    jobs += [(("saved tied",), functools.partial(pipelined_losses, case=TIED_SAVED, pp=2, disk=disk / "st",
                                                 save_to=tied_out)),
             (("resumed tied",), functools.partial(pipelined_losses, case=TIED_RESUMED, pp=2, disk=disk / "rt",
                                                   load_from=tied_out)),
             (("from one tied",), functools.partial(resumed_from_one_process, pp=2, disk=disk / "ot",
                                                    out=tmp_path_factory.mktemp("onetied"), case=TIED_RESUMED))]
    jobs += [(("meta",), functools.partial(meta_built, pp=2, disk=disk / "meta"))]
    llama_out = tmp_path_factory.mktemp("pp2llama")
    jobs += [(("saved llama",), functools.partial(pipelined_losses, case=LLAMA_SAVED, pp=2, disk=disk / "sl",
                                                  save_to=llama_out))]
    return {**run_ranks(2, tmp_path_factory.mktemp("pp2"), jobs), "out": out, "tied out": tied_out,
            "llama out": llama_out}


@pytest.fixture(scope="module")
def pp2_dp2(tmp_path_factory):
    disk, out = tmp_path_factory.mktemp("pp2dp2d"), tmp_path_factory.mktemp("pp2dp2run")
    jobs = _jobs(PP2_DP2, 2, disk, Case("aiao", 4, 2)) + _checkpoint_jobs(2, disk, out, resume=False)
    experts = tmp_path_factory.mktemp("pp2dp2moe")  # each stage's experts over its two replicas, saved after step 1
    jobs += [(("saved moe",), functools.partial(pipelined_losses, case=MOE_SAVED, pp=2, disk=disk / "sm",
                                                save_to=experts))]
    jobs += [(("meta",), functools.partial(meta_built, pp=2, disk=disk / "meta"))]
    return {**run_ranks(4, tmp_path_factory.mktemp("pp2dp2"), jobs), "out": out, "moe out": experts}


def _check(results, case, world, dp, tmp):
    want = (reference(dp, case.micro, case.clip, tied=case.tied, family=case.family) if case.dtype == "fp32"
            else tiered_reference(case, tmp))
    for rank in range(world):
        got = results[((case,), rank)]
        mine = [step[got["replica"]] for step in want]
        if case.clip is None and case.ep == 1 and (not case.tied or (case.micro, dp) == (1, 1)):
            assert got["losses"] == mine, f"rank {rank}"
        else:
            assert got["losses"][0] == mine[0]  # nothing clipped, and no tied weight changed, before the first step
            flat = [x for step in got["losses"] for x in step]
            rtol = TIED_RTOL if case.tied else CLIP_RTOL
            assert flat == pytest.approx([x for step in mine for x in step], rel=rtol, abs=0), f"rank {rank}"


@pytest.mark.parametrize("case", PP2, ids=str)
def test_two_stages_train_as_one_process_accumulating_the_micro_batches(pp2, case, tmp_path):
    _check(pp2, case, 2, 1, tmp_path)


@pytest.mark.parametrize("case", PP2_DP2, ids=str)
def test_two_stages_over_two_replicas_train_as_one_process_averaging_them(pp2_dp2, case, tmp_path):
    _check(pp2_dp2, case, 4, 2, tmp_path)


def test_bf16_stages_compute_in_bf16(pp2, tmp_path):
    """The bf16 runs above are not fp32 ones under another name."""
    assert pp2[((BF16[1],), 0)]["losses"] != pp2[((Case("aiao", 4, 2),), 0)]["losses"]


def test_clipping_changes_the_steps_it_should(pp2):
    """The clipped runs above are not the unclipped ones (0.05 clips these gradients)."""
    clipped = pp2[((Case("aiao", 4, 2, clip=0.05),), 0)]["losses"]
    free = pp2[((Case("aiao", 4, 2),), 0)]["losses"]
    assert clipped[0] == free[0] and clipped[1:] != free[1:]


def test_aiaos_stashed_activation_checkpoints_wait_in_host_memory_as_eq_7_counts(pp2):
    """Every block recomputed with its input offloaded: each rank's stash of an AIAO step (every micro-batch
    of each of its 2 segments, FOLD3D's eq. 7: M x ns checkpoints) is in host memory, none left where it
    was made, and it grows with M (twice the micro-batches, twice the bytes)."""
    for rank in (0, 1):
        four, eight = pp2[(("stash", 4), rank)], pp2[(("stash", 8), rank)]
        assert four["kept"] == eight["kept"] == 0
        assert four["peak"] >= 4 * 2 * four["checkpoint"] and eight["peak"] == 2 * four["peak"], (four, eight)


def test_aiaos_inter_segment_outputs_wait_in_the_receivers_host_memory(pp2):
    """FOLD3D §4's lazy inter-segment communication: rank 0's second-segment stage receives each of the M
    micro-batches segment 1 sends it (every step) into its host pool, several waiting at once for the forward
    of its own first segment to end, each freed as its forward takes it; rank 1 receives none so (its stages
    take inputs inside a segment). The AIAO losses above are one process's with it."""
    zero, one = pp2[(("inbox", 4), 0)], pp2[(("inbox", 4), 1)]
    assert zero["received"] == 2 * 4 and zero["kept"] == 0 and zero["most"] >= 2, zero
    assert zero["peak"] >= zero["most"] * zero["input"] and zero["left"] == [0, 0], zero
    assert zero["let_go"], zero  # torch's device buffers for them let go: nothing waits on the device
    assert one["received"] == one["kept"] == 0 and one["left"] == [0, 0], one
    # no room in the host pool (states on the device, as exact a plan): received beside it, the same steps
    full = pp2[(("inbox full", 4), 0)]
    assert full["kept"] == 2 * 4 and full["received"] == 0 and full["let_go"], full
    assert full["losses"] == zero["losses"]


def test_each_backward_prefetches_the_next_micro_batchs_stashed_checkpoints(pp2):
    """FOLD3D §4: a stage's backward of micro-batch j starts copying micro-batch j + 1's stashed checkpoints
    back, so every micro-batch's but the first's (per stage) are on the device before their backward asks;
    the losses with the stash equal one process's (the ``stash`` cases above)."""
    for rank in (0, 1):
        for m in (4, 8):
            got = pp2[(("stash", m), rank)]
            assert got["stashed"] > 0 and got["prefetched"] == got["stashed"] * (m - 1) // m, (m, got)
            assert got["tags"][0] == got["tags"][1] > 0, got  # the first micro-batch's, one step's worth


def test_aiao_issues_each_segments_dp_sync_before_the_segment_before_it_runs_backward(pp2_dp2):
    """On every rank, each stage's gradient reductions over its data-parallel group are issued during its
    last micro-batch's backward, and the later segment's all before the earlier segment's first backward;
    none lands before the earlier segment's last backward has begun (FOLD3D Alg. 1: DP.sync of segment k
    runs under segment k-1's backward). REDUCE_GRAD comes in the same order. The step lands none of them
    and updates no block: each lands at its block's next use, which updates the block first (Alg. 1 line 5,
    Alg. 2's forward part), so the later segment's land under the next step's forward of the earlier one."""
    for rank in range(4):
        got = pp2_dp2[(("events",), rank)]
        events, (early, late) = got["events"], got["indices"]
        stepping, stepped = events.index(("step", 0)), events.index(("stepped", 0))
        backwards = [i for i, e in enumerate(events[:stepping]) if e == ("backward", late)]
        syncs = [i for i, e in enumerate(events[:stepping]) if e == ("sync", late)]
        assert len(backwards) == 4 and syncs, events
        assert min(syncs) > backwards[-1]  # the last micro-batch's backward issues them
        first_early = events.index(("backward", early))
        assert max(syncs) < first_early, events
        assert any(e == ("sync", early) for e in events[first_early:stepping])
        last_early = max(i for i, e in enumerate(events[:stepping]) if e == ("backward", early))
        assert not any(e[0] == "landed" for e in events[:last_early]), events
        nxt = events[stepped:]
        in_flight = {e[1:] for e in nxt if e[0] == "landed"}
        in_step = events[stepping:stepped]
        assert in_flight and not any(e[0] == "landed" or e[1:] in in_flight for e in in_step), in_step  # none waited for
        landed = [i for i, e in enumerate(nxt) if e[:2] == ("landed", late)]
        assert len(landed) == len(syncs) and min(landed) > nxt.index(("forward", early)), events
        for v in (early, late):  # each block: landed, updated, then used
            for i in {e[2] for e in nxt if e[:2] == ("landed", v)}:
                at = [nxt.index((kind, v, i)) for kind in ("landed", "updated", "ready")]
                assert at == sorted(at), (v, i, nxt)
        assert got["synced"] == [late, early]


@pytest.mark.parametrize("change, says", [
    (dict(dropout=0.1), "dropout .* build the model with dropout=0"),
])
def test_a_model_the_pipeline_cannot_cut_is_refused_before_any_rank_starts(change, says):
    from pp_harness import TINY

    from tiertrain.api.pipeline import pipeline
    from tiertrain.errors import ConfigError
    from tiertrain.models import build
    from tiertrain.plan.pipeline import PipelineLayout

    model = build({**TINY, **change})
    with pytest.raises(ConfigError, match=says):
        pipeline(model, torch.optim.AdamW(model.parameters()), PipelineLayout(pp=2))


@pytest.mark.parametrize("spec, says", [
    ({"model_type": "opt", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "ffn_dim": 64, "word_embed_proj_dim": 32},
     "transformers llama, qwen2, mistral, gpt2, gpt_neox models; a OPTForCausalLM has no stages yet"),
    ({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 256},
     r"dropout \(attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1\) is not supported yet"),
    ({"model_type": "granite", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "embedding_multiplier": 12.0},
     "a GraniteForCausalLM has no stages yet"),
    ({"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["full_attention", "sliding_attention"]},
     "layers differ in attention .* give every layer one attention type"),
])
def test_a_transformers_model_a_stage_could_not_compute_is_refused_in_one_line(spec, says):
    from tiertrain.api.pipeline import pipeline
    from tiertrain.errors import ConfigError
    from tiertrain.models import build
    from tiertrain.plan.pipeline import PipelineLayout

    model = build(spec)
    with pytest.raises(ConfigError, match=says):
        pipeline(model, torch.optim.AdamW(model.parameters()), PipelineLayout(pp=2))


def test_every_familys_tied_weight_is_one_a_checkpoint_reads_once():
    """The last stage's copy of a tied embedding is read from the first stage's (``checkpoint.pipelined
    .tied_copy``): every family's tied weight must be among the names it knows."""
    from tiertrain.models.hf_stages import PARTS
    from tiertrain.models.stages import TIED_NAMES

    assert {p.tied_name for p in PARTS.values()} <= TIED_NAMES


@pytest.mark.parametrize("fields, says", [
    (dict(max_grad_norm=1.0, update="overlap"), "clipping in a pipelined run .* use --update sync"),
    (dict(grad_accum=3), "accumulates its 4 micro-batches: leave grad_accum out"),
    (dict(compute_dtype="fp16"), "in fp32 or bf16, not fp16 .* use bf16"),
])
def test_options_a_pipeline_cannot_run_yet_are_refused_in_one_line(fields, says):
    from pp_harness import fresh

    from tiertrain.api.pipeline import pipeline
    from tiertrain.errors import ConfigError
    from tiertrain.plan.pipeline import PipelineLayout

    model, opt = fresh()
    with pytest.raises(ConfigError, match=says):
        pipeline(model, opt, PipelineLayout(pp=2, micro_batches=4), **fields)
    with pytest.raises(ConfigError, match="a Linear has no stages yet"):
        pipeline(torch.nn.Linear(2, 2), opt, PipelineLayout(pp=2))


@pytest.mark.parametrize("layout, fields, says", [
    (dict(pp=2), dict(update="overlap"), "tied embedding in a pipeline sums .* use update='sync'"),
    (dict(pp=1, schedule="aiao", segments=2), {}, "on one rank .* give segments=1"),
])
def test_what_a_tied_embedding_cannot_be_split_over_is_refused_in_one_line(layout, fields, says):
    from pp_harness import fresh

    from tiertrain.api.pipeline import pipeline
    from tiertrain.errors import ConfigError
    from tiertrain.plan.pipeline import PipelineLayout

    model, opt = fresh(tied=True)
    with pytest.raises(ConfigError, match=says):
        pipeline(model, opt, PipelineLayout(micro_batches=4, **layout), **fields)
    assert model.lm_head.weight is model.tok_emb.weight  # refused before anything changed


def test_a_lost_stage_ends_the_other_ranks_step_naming_it(tmp_path):
    """Rank 1 (the last stage) is killed as the second step begins: rank 0, waiting in torch's receive for
    its gradients, stops within the heartbeat's staleness (not the collective timeout), naming rank 1."""
    from dp_harness import run_ranks_one_dies
    from pp_harness import stage_dies

    errors, codes = run_ranks_one_dies(2, tmp_path, stage_dies)
    said, after = errors[0]
    assert said.startswith("RankLost: rank 1 of 2 stopped") and "--resume" in said, said
    assert after < 60 and codes[1] == -9, (after, codes)


def test_a_pipelined_checkpoint_resumes_with_the_model_cut_otherwise(pp2):
    """Saved after step 1 of a 1F1B run over 2 stages, resumed by an AIAO run over 4 (2 segments): its
    steps 2 and 3 are the uninterrupted run's, bit for bit."""
    for rank in range(2):
        assert pp2[(("resumed",), rank)]["losses"] == pp2[(("saved",), rank)]["losses"][1:], f"rank {rank}"


def test_a_one_process_checkpoint_resumes_as_a_pipeline(pp2):
    """One process of plain PyTorch saves after step 1; an AIAO pipeline over 4 stages goes on from it with
    that process's steps 2 and 3, bit for bit (each stage reads its own parameters out of the whole model's)."""
    want = reference(1, 4)
    for rank in range(2):
        assert pp2[(("from one",), rank)]["losses"] == [step[0] for step in want[1:]], f"rank {rank}"


@pytest.mark.parametrize("fixture,dp", [("pp2", 1), ("pp2_dp2", 2)])
def test_a_pipelined_checkpoint_resumes_in_one_process_of_plain_pytorch(request, fixture, dp):
    """pp = 2 (each stage's files one process's) and pp = 2 x dp = 2 (each stage's sharded over its two
    replicas): the checkpoint after step 1 loads into one process's model and AdamW, and its steps 2 and 3
    are the pipelined run's, bit for bit."""
    from pp_harness import fresh
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    results = request.getfixturevalue(fixture)
    model, opt = fresh()
    names = {i: n for i, n in enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                                        + [n for n, p in model.named_parameters() if p.dim() < 2])}
    state = load_checkpoint(find_checkpoint(results["out"]), PlainState(model, opt, names))
    assert (state.step, state.world) == (1, 2 * dp)
    want = reference(dp, SAVED.micro, start=(model, opt), first=state.step)
    for rank in range(2 * dp):
        got = results[(("saved",), rank)]
        assert got["losses"][1:] == [step[got["replica"]] for step in want], f"rank {rank}"


def test_a_pipelined_checkpoint_with_experts_over_the_replicas_resumes_in_one_process_of_plain_pytorch(pp2_dp2):
    """pp = 2 x dp = 2 with each stage's experts divided over its two replicas (expert parallel), saved after
    step 1: every stage's experts, each written by the replica holding it, load into one process, whose
    steps 2 and 3 are the pipeline's within CLIP_RTOL (an expert summed both replicas' micro-batches in
    their order: not bit for bit)."""
    from pp_harness import fresh
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    model, opt = fresh(family="moe")
    names = {i: n for i, n in enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                                        + [n for n, p in model.named_parameters() if p.dim() < 2])}
    state = load_checkpoint(find_checkpoint(pp2_dp2["moe out"]), PlainState(model, opt, names))
    assert (state.step, state.world) == (1, 4)
    want = reference(2, MOE_SAVED.micro, start=(model, opt), first=state.step)
    for rank in range(4):
        got = pp2_dp2[(("saved moe",), rank)]
        flat = [x for step in got["losses"][1:] for x in step]
        assert flat == pytest.approx([x for step in want for x in step[got["replica"]]], rel=CLIP_RTOL, abs=0), rank


def test_a_tied_pipelined_checkpoint_resumes_cut_otherwise_in_one_process_and_from_one_process(pp2):
    """A tied model's pipelined checkpoint (the first stage's weight and the last stage's copy) resumed over 4
    stages and in one process of plain PyTorch, and a one process's checkpoint resumed as a pipeline (the
    last stage's copy read from the embedding's weight): each goes on bit for bit (one micro-batch a step)."""
    from pp_harness import fresh
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    want = [step[0] for step in reference(1, 1, tied=True)]
    model, opt = fresh(tied=True)
    names = dict(enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                           + [n for n, p in model.named_parameters() if p.dim() < 2]))
    assert load_checkpoint(find_checkpoint(pp2["tied out"]), PlainState(model, opt, names)).step == 1
    plain = [step[0] for step in reference(1, 1, start=(model, opt), first=1, tied=True)]
    for rank in range(2):
        saved = pp2[(("saved tied",), rank)]["losses"]
        assert saved == want and plain == want[1:], f"rank {rank}"
        assert pp2[(("resumed tied",), rank)]["losses"] == want[1:], f"rank {rank}"
        assert pp2[(("from one tied",), rank)]["losses"] == want[1:], f"rank {rank}"
    # the head is the last stage's (rank 1's); rank 0's model lets its registration of the tied weight go too
    assert pp2[(("saved tied",), 0)]["head_released"] and not pp2[(("saved tied",), 1)]["head_released"]
    assert model.lm_head.weight is model.tok_emb.weight  # the one process's model stays tied


def _copy_of_saved(pp2, tmp_path):
    import shutil

    from tiertrain.checkpoint.run import find_checkpoint

    ckpt = tmp_path / "step-00000001"
    shutil.copytree(find_checkpoint(pp2["out"]), ckpt)
    return ckpt


def _plain():
    from pp_harness import fresh
    from tiertrain.checkpoint.train_state import PlainState

    model, opt = fresh()
    names = {i: n for i, n in enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                                        + [n for n, p in model.named_parameters() if p.dim() < 2])}
    return model, PlainState(model, opt, names)


@pytest.mark.parametrize("damage,says", [
    ("flip", "is missing or damaged"), ("no stage", "stage-001 is missing"), ("stage step", "is of step 7"),
    ("record", "pipeline"), ("twice", "is saved by two stages")])
def test_a_damaged_pipelined_checkpoint_is_refused_before_anything_loads(pp2, tmp_path, damage, says):
    import json
    import shutil

    from tiertrain.checkpoint.run import load_checkpoint
    from tiertrain.errors import CheckpointError

    ckpt = _copy_of_saved(pp2, tmp_path)
    stage = ckpt / "stage-001"
    if damage == "flip":
        data = bytearray((stage / "model.safetensors").read_bytes())
        data[-5] ^= 0xFF
        (stage / "model.safetensors").write_bytes(bytes(data))
    elif damage == "no stage":
        shutil.rmtree(stage)
    elif damage in ("stage step", "record"):
        path = stage / "trainer.json" if damage == "stage step" else ckpt / "trainer.json"
        trainer = json.loads(path.read_text())
        trainer.update({"step": 7} if damage == "stage step" else {"pipeline": {"pp": 2}})
        path.write_text(json.dumps(trainer))
    else:  # stage 1's files where stage 0's were: every tensor of it saved twice
        shutil.rmtree(ckpt / "stage-000")
        shutil.copytree(stage, ckpt / "stage-000")
    model, state = _plain()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=says):
        load_checkpoint(ckpt, state)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_pipelined_checkpoint_exports_the_whole_models_weights(pp2, tmp_path):
    from safetensors.torch import load_file

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.checkpoint.run import load_checkpoint

    import shutil

    from tiertrain.errors import CheckpointError

    ckpt = _copy_of_saved(pp2, tmp_path)
    twice = tmp_path / "twice" / "step-00000001"
    shutil.copytree(ckpt, twice)
    shutil.rmtree(twice / "stage-000")
    shutil.copytree(twice / "stage-001", twice / "stage-000")
    with pytest.raises(CheckpointError, match="saved by two stages"):
        export_checkpoint(twice, tmp_path / "bad", say=lambda _: None)
    export_checkpoint(ckpt, tmp_path / "hf", say=lambda _: None)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    model, state = _plain()
    load_checkpoint(ckpt, state)
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_tied_pipelined_checkpoint_exports_the_weight_once(pp2, tmp_path):
    """The tied embedding (the first stage's weight, the last stage's copy) is exported once, as a one-process
    checkpoint of the tied model stores it; every tensor is the resumed model's."""
    from safetensors.torch import load_file

    from pp_harness import fresh
    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    ckpt = find_checkpoint(pp2["tied out"])
    export_checkpoint(ckpt, tmp_path / "hf", say=lambda _: None)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    model, opt = fresh(tied=True)
    names = dict(enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                           + [n for n, p in model.named_parameters() if p.dim() < 2]))
    load_checkpoint(ckpt, PlainState(model, opt, names))
    want = dict(model.named_parameters())  # the tied weight under its one name
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].detach()) for k in want)


@pytest.mark.parametrize("fixture,world", [("pp2", 2), ("pp2_dp2", 4)])
def test_a_model_built_on_the_meta_device_trains_as_a_pipeline_with_its_tied_weight_one(request, fixture, world):
    """No rank builds the whole model: each draws its stages' weights where they live (seeded otherwise on
    every rank); the tied weight is drawn once and sent to the last stage, so the first stage's weight and
    the last stage's copy are equal before and after training, on every replica (which take their first
    replica's weights); the parts other ranks hold never leave the meta device."""
    got = [request.getfixturevalue(fixture)[(("meta",), rank)] for rank in range(world)]
    for g in got[1:]:  # pp = 2: every rank holds an end of the tied weight
        assert torch.equal(g["before"], got[0]["before"]) and torch.equal(g["after"], got[0]["after"])
        assert g["losses"] == got[0]["losses"]  # the replicas, on the same batches, take the same steps
    assert not torch.equal(got[0]["before"], got[0]["after"])  # trained
    assert all(math.isfinite(x) for g in got for step in g["losses"] for x in step)
    assert all(g["others_meta"] for g in got if g["others_meta"] is not None)  # rank 0 never drew the last blocks


def test_a_pipelined_llama_checkpoint_resumes_in_one_process_of_plain_transformers(pp2):
    """A transformers Llama's stages save under the model's names: the checkpoint after step 1 loads into the
    plain model and its AdamW, and their steps 2 and 3 are the pipelined run's, bit for bit."""
    from pp_harness import fresh
    from tiertrain.checkpoint.run import find_checkpoint, load_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    model, opt = fresh(family="llama")
    names = dict(enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                           + [n for n, p in model.named_parameters() if p.dim() < 2]))
    assert load_checkpoint(find_checkpoint(pp2["llama out"]), PlainState(model, opt, names)).step == 1
    want = reference(1, LLAMA_SAVED.micro, start=(model, opt), first=1, family="llama")
    for rank in range(2):
        assert pp2[(("saved llama",), rank)]["losses"][1:] == [step[0] for step in want], f"rank {rank}"
