"""A tied weight's head gradient joins the grad chunk as backward starts (``runtime.tied``), not at its end."""

from __future__ import annotations

import time

import pytest
import torch

import tiertrain
import tiertrain.runtime.block_group as updater
from tiertrain.runtime import in_place_grads
from tiered_harness import HF_GPT2, TINY4, _fresh, _loop, batches, train_plain
from tiertrain.train.objective import lm_loss
from tiertrain.memory import Budgets
from tiertrain.plan import builtin_plan
from tiertrain.plan.fit import alive_grad_bytes
from tiertrain.runtime.blocks import find_blocks
from conftest import needs
from tiertrain.plan.tiers import Tier

PAGE = 64 * 1024
WIDE = {**TINY4, "vocab_size": 8192}  # the embeddings' chunk is larger than any block's: a place of its own
WIDE_HF = {**HF_GPT2, "vocab_size": 8192, "n_layer": 4}


def _embedding(model: torch.nn.Module) -> torch.nn.Parameter:
    return model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else model.tok_emb.weight


def _run(spec, update: str, bounded: bool, accum: int = 1):
    """Losses of 3 steps, per step whether the tied weight's gradient was already in the rest's chunk
    when backward reached the first block (the last block it reaches before the embeddings), and the
    peak bytes of host gradient chunks."""
    plan = builtin_plan("stream", spec["n_layer"], update=update)
    blocks = find_blocks(_fresh(spec)[0])
    few, every = (needs(blocks, plan, PAGE, transient_grads=t)[Tier.HOST] for t in (True, False))
    model, opt = _fresh(spec)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=64 << 20, host=few if bounded else every), plan=plan,
                               grad_accum=accum, page_size=PAGE)
    rt, seen = tm.runtime, []
    rest, first = rt.groups[-1], rt.groups[0]
    index = next(i for i, p in enumerate(rest.params) if p is _embedding(tm))
    first.block.module.register_full_backward_pre_hook(
        lambda m, g: seen.append(rest.grad_views()[index] is not None))
    try:
        assert rt.bounded_grads is bounded
        losses = _loop(tm, topt, tm.clip_grad_norm_, 3, accum, None)
        stats = rt.mem.stats()["host"]
        reserved = alive_grad_bytes([g.nbytes for g in rt.groups], plan.update_workers, 1, 0)
    finally:
        rt.close()
        rt.mem.close()
    assert stats["pages_peak_bytes"] <= (few if bounded else every)
    return losses, seen, (stats["peak_by_kind"]["grad"], reserved)


@pytest.mark.parametrize("spec", [WIDE, WIDE_HF], ids=["gpt", "transformers"])
@pytest.mark.parametrize("update, bounded", [("sync", False), ("overlap", True)])
def test_the_heads_gradient_of_a_tied_embedding_is_in_the_chunk_before_backward_ends(spec, update, bounded,
                                                                                     monkeypatch):
    """Autograd would hold the head's gradient outside every pool until the embedding's arrives, at the
    end of backward. Here it is in the rest's grad chunk before the last block's backward, and the losses
    are plain PyTorch's bit for bit (head + embedding, as autograd adds them). With bounded gradients the
    host stays within its budget, and the rest's chunk, held through backward in a place of its own, does
    not narrow the blocks' pipeline: with updates slowed, backward fills every place the budget reserved."""
    slow = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.05), slow(*a)))
    losses, seen, (grad_peak, reserved) = _run(spec, update, bounded)
    assert losses == train_plain(spec, 3, 1, None)
    assert seen == [True] * 3
    if bounded:
        assert grad_peak == reserved


@pytest.mark.parametrize("spec", [WIDE, {**WIDE, "tie_embeddings": False}, WIDE_HF], ids=["gpt", "untied", "transformers"])
@pytest.mark.parametrize("accum", [1, 2])
def test_autograd_makes_no_gradient_of_the_head_or_the_embedding_they_are_written_into_the_rests_chunk(
        spec, accum, monkeypatch):
    """The head's and the embedding's gradients (vocab x d each) are made in the rest's grad chunk
    (``runtime.in_place_grads``): each use's backward writes its gradient there and hands autograd none,
    and the losses are plain PyTorch's bit for bit. Over two micro-batches autograd's path runs, as plain
    PyTorch's."""
    n = spec["n_layer"]
    written = []
    monkeypatch.setattr(in_place_grads.Target, "written", lambda self, w=in_place_grads.Target.written: (
        written.append(self.index), w(self))[1])
    model, opt = _fresh(spec)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=64 << 20, host=64 << 20), plan=builtin_plan("stream", n),
                               grad_accum=accum, page_size=PAGE)
    rt = tm.runtime
    wide = [p for p in rt.groups[-1].params if p.shape[0] == 8192]
    rest = {id(p) for p in rt.groups[-1].params}
    uses = sum(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and id(m.weight) in rest for m in tm.modules())
    try:
        losses = _loop(tm, topt, None, 3, accum, None)
    finally:
        rt.close()
        rt.mem.close()
    assert losses == train_plain(spec, 3, accum, None)
    assert len(wide) == (1 if spec.get("tie_embeddings", True) else 2)
    assert uses >= 2 and len(written) == (uses * 3 if accum == 1 else 0)  # every use of a rest weight, each step


def test_a_users_hook_on_the_head_weight_sees_autograds_gradient_and_may_change_it():
    """A hook the user puts on the tied head's weight (``register_hook``) gets its gradient, not None,
    and what it returns is what trains: the weight takes autograd's path, as in plain PyTorch."""
    def train(tiered: bool) -> tuple[list[float], int]:
        model, opt = _fresh(WIDE)
        seen = []
        if tiered:
            model, opt = tiertrain.setup(model, opt, Budgets(device=64 << 20, host=64 << 20),
                                         plan=builtin_plan("stream", WIDE["n_layer"]), page_size=PAGE)
        _embedding(model).register_hook(lambda g: (seen.append(g.shape), g * 0.5)[1])
        try:
            return _loop(model, opt, None, 3, 1, None), len(seen)
        finally:
            if tiered:
                model.runtime.close()
                model.runtime.mem.close()

    tiered, plain = train(True), train(False)
    assert tiered == plain and plain[1] == 3  # once a step, the head's and the embedding's summed


def test_with_several_micro_batches_the_tied_gradients_are_summed_by_autograd_as_before():
    """Over micro-batches the uses would be added in another order than autograd's (not bitwise): there
    the head's gradient waits for the embedding's, as in plain PyTorch."""
    losses, seen, _ = _run(WIDE, "sync", False, accum=2)
    assert losses == train_plain(WIDE, 3, 2, None)
    assert seen[0::2] == [False] * 3  # each step's first micro-batch (the second finds the first's in the chunk)


def test_where_the_rests_chunk_is_a_blocks_size_bounded_gradients_keep_the_head_gradient_in_autograd(monkeypatch):
    """The budget gives the rest's chunk no place of its own when it is as large as a block's (``d_ffn``
    chosen so): held through backward it would take a block's place. So there the head's gradient waits
    in autograd, and backward never holds more grad chunks than the budget reserved."""
    spec = {**TINY4, "d_ffn": 91}
    slow = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.05), slow(*a)))
    losses, seen, (grad_peak, reserved) = _run(spec, "overlap", True)
    assert losses == train_plain(spec, 3, 1, None)
    assert seen == [False] * 3 and grad_peak <= reserved


def test_a_tied_embedding_updated_in_pieces_has_its_head_gradient_in_the_device_chunk_before_backward_ends(
        tmp_path, monkeypatch):
    """Updated in pieces, the rest's gradients wait on the device (``plan.bytes.grad_tier``); bounded there,
    its chunk also has a place of its own, so the head's gradient joins it at once, backward fills (updates
    slowed) but never exceeds the gradients the budget reserved, and the losses are plain PyTorch's."""
    import dataclasses

    from tiertrain.plan import BlockPlan, Plan
    from tiertrain.plan.fit import bounded_grads, tier_bytes
    from tiertrain.runtime.blocks import block_numel

    spec = {**WIDE, "n_layer": 4}
    disk = BlockPlan(home=Tier.DISK, stream=True, piece=2 * 4096)
    plan = Plan((disk,) * 4, dataclasses.replace(disk, stream=False), window=2, prefetch=1, update="overlap",
                update_workers=1)
    numels = [block_numel(b) for b in find_blocks(_fresh(spec)[0])]
    few = tier_bytes(numels, plan, 4096, grads="transient")[Tier.DEVICE]
    slow = updater.adamw_block
    monkeypatch.setattr(updater, "adamw_block", lambda *a: (time.sleep(0.05), slow(*a)))
    model, opt = _fresh(spec)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=few, host=4 << 20, disk=64 << 20, disk_dir=str(tmp_path)),
                               plan=plan, page_size=4096)
    rt, seen = tm.runtime, []
    rest = rt.groups[-1]
    index = next(i for i, p in enumerate(rest.params) if p is _embedding(tm))
    rt.groups[0].block.module.register_full_backward_pre_hook(
        lambda m, g: seen.append(rest.grad_views()[index] is not None))
    try:
        assert rt.bounded_grads and rt.backward.tied_early
        losses = _loop(tm, topt, None, 3, 1, None)
        peak = rt.mem.stats()["device"]["peak_by_kind"]["grad"]
    finally:
        rt.close()
        rt.mem.close()
    assert losses == train_plain(spec, 3, 1, None)
    reserved = alive_grad_bytes([g.nbytes for g in rt.groups], plan.update_workers, 1, 0)
    assert seen == [True] * 3 and peak == reserved <= bounded_grads(numels, plan, 4096)[Tier.DEVICE]


@pytest.mark.parametrize("update", ["sync", "overlap"])
def test_a_head_registered_before_the_embedding_leaves_the_embeddings_use_its_own_leaf_and_stays_exact(update):
    """Where the head comes first in ``model.modules()``, the embedding's use is the one with its own
    leaf, and its gradient arrives after every parameter the group counts (the final norm, the tied weight
    through the head, the positions beside it): the group must not flush, nor its update start, before
    it. The losses are plain PyTorch's bit for bit."""
    from tiertrain.runtime.tied import extra_uses

    model, opt = _fresh(WIDE)
    mods = dict(model._modules)
    model._modules.clear()
    model._modules.update({"lm_head": mods.pop("lm_head"), **mods})
    assert [u.module for u in extra_uses(model, [model.lm_head.weight])] == [model.tok_emb]
    plan = builtin_plan("stream", WIDE["n_layer"], update=update)
    tm, topt = tiertrain.setup(model, opt, Budgets(device=64 << 20, host=256 << 20), plan=plan, page_size=PAGE)
    try:
        assert tm.runtime.backward.tied_early
        losses = _loop(tm, topt, tm.clip_grad_norm_, 4, 1, None)
        with pytest.raises(IndexError):  # a forward that raises
            tm(torch.full((1, 4), WIDE["vocab_size"] + 1))
        assert tm.tok_emb.weight is tm.lm_head.weight  # the parameter is back in place after every forward
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert losses == train_plain(WIDE, 4, 1, None)


def _penalised(tiered: bool, autocast: bool = False) -> list[tuple[float, float]]:
    """Three steps whose every loss is first differentiated by ``torch.autograd.grad`` with respect to a
    block's weight (a gradient penalty's call: through the head, accumulating nothing), then backward,
    under the CPU's autocast where asked."""
    model, opt = _fresh(WIDE)
    if tiered:
        model, opt = tiertrain.setup(model, opt, Budgets(device=64 << 20, host=64 << 20),
                                     plan=builtin_plan("resident", WIDE["n_layer"]), page_size=PAGE)
    weight = dict(model.named_parameters())["blocks.0.ffn.fc.weight"]
    out = []
    try:
        for b in batches(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = lm_loss(model, b[:, :-1], b[:, 1:])
            (g,) = torch.autograd.grad(loss, [weight], retain_graph=True)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append((loss.item(), g.norm().item()))
        return out
    finally:
        if tiered:
            model.runtime.close()
            model.runtime.mem.close()


def test_autograd_grad_through_the_head_writes_no_gradient_and_a_step_after_it_trains_as_plain_pytorchs():
    """``torch.autograd.grad`` adds nothing to any ``.grad`` in plain PyTorch: the head's and the
    embedding's functions write nothing into the rest's chunk there (the chunk would hold a gradient
    plain PyTorch never adds, and backward would count a micro-batch too many)."""
    assert _penalised(True) == _penalised(False)


def test_under_the_users_autocast_the_head_and_embedding_take_autograds_path():
    """An fp32 plan in a loop under ``torch.autocast`` (a transformers Trainer with bf16=True): the head's
    product comes in bf16, so its gradient is not written into the fp32 chunk; the run trains as plain
    PyTorch under the same autocast."""
    assert _penalised(True, autocast=True) == _penalised(False, autocast=True)
