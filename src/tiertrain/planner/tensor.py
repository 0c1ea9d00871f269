"""Tensor parallel in the planner (issue 39): what one rank of a group of T plans for, and what the group's
sums cost it.

A rank holds 1/T of each block's cut parameters (Megatron's layout, ``parallel.tensor_plans``) and the whole
of the rest (its norms and projection biases: ``whole`` elements a block, which the caller counts from the
model), computes 1/T of the block's matrix products and attention, and saves 1/T of what its cut layers
keep for backward. What stays whole on every rank is taken as five times the block's input bytes: of a
layer's 34 s b h bytes of saved activations (Korthikanti et al. 2022, §4.1, 16-bit, without sequence
parallel), the 10 s b h its norms, dropout masks and residual keep whole are 5 inputs' worth.

Each forward waits for two sums of the block's output (its input's size, in the compute dtype), each
backward for two more and a recompute for one (torch's checkpoint stops at the last tensor backward
needs, short of the MLP's sum); a mixture-of-experts layer sums each expert's tokens, ``routed`` (its
top-k) tokens' worth where a dense MLP sums one, and a recompute sums them again (backward needs each
expert's output, to weigh it by its gate): ring all-reduces over the group's link, on the compute's critical path
(FOLD3D's T_ip, what never overlaps), so they are added to the block's times.
"""

from __future__ import annotations

import dataclasses

from tiertrain.planner.profile import BlockProfile, Profile

WHOLE_INPUTS = 5      # saved activations every rank keeps whole, in block inputs' worth (module docstring)
REGATHERS = 2         # under sequence parallel: the column layers' inputs gathered again in backward
FORWARD_SUMS, BACKWARD_SUMS, RECOMPUTE_SUMS = 2, 2, 1  # of a dense block: one attention's, one its MLP's


def all_reduce_s(nbytes: float, ranks: int, bps: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``ranks`` at ``bps`` a rank: 2 (T-1)/T of the buffer each way."""
    return 2 * (ranks - 1) / ranks * nbytes / bps if ranks > 1 and bps > 0 else 0.0


def for_tensor(p: Profile, tp: int, bps: float, whole: int, routed: int = 1, sequence: bool = False,
               summed: int | None = None) -> Profile:
    """The profile of one rank of a tensor-parallel group of ``tp`` over a link of ``bps`` (each block's
    ``whole`` elements on every rank; ``routed``: the experts a token goes to, 1 for a dense MLP;
    ``sequence``: sequence parallel, what the norms and residuals keep sliced too, and the column layers
    their input's slice (gathered again in backward: Megatron's), the block's input a slice (what a
    recompute keeps, and a pipeline stage sends on), its all-gathers and reduce-scatters the
    bytes of the all-reduces they replace, a recompute half a sum more, and the ``summed`` whole elements'
    gradients (all ``whole`` by default) summed backward; a mixture of experts runs whole between the
    slices: its gathered input, kept by the router and once per routed expert, whole, its gather forward
    half a sum more, and the gather of its output's gradient in place of the MLP's re-gather); the rest
    (embeddings, head) whole, as the ranks hold it."""
    if tp == 1:
        return p
    summed = whole if summed is None else summed
    return dataclasses.replace(p, blocks=tuple(_cut(b, tp, bps, whole, routed, sequence, summed) for b in p.blocks))


def with_stage_ends(p: Profile, before: bool, after: bool, tp: int, bps: float) -> Profile:
    """``p`` (a rank's cut profile under sequence parallel, its hidden bytes a slice) with the seconds a
    pipeline stage's ends gather the whole sequence, each way: a stage after the first of a model that builds
    what its blocks read from its input's length gathers its input (``TensorPlan.length_before_blocks``:
    forward, and its slicing's backward), and a stage before the last of one whose base views its output to
    the whole length its output too (``views_after_blocks``: GPT-2). An all-gather of the whole hidden states
    each: half a sum. The pipeline's planner charges them to the stages that have those ends
    (``planner.pipeline``)."""
    one = 0.5 * all_reduce_s(max(b.hidden_bytes for b in p.blocks) * tp, tp, bps)
    return dataclasses.replace(p, gather_in_s=one if before else 0.0, gather_out_s=one if after else 0.0)


def sums_s(p: Profile, cut: Profile, tp: int) -> float:
    """A step's collectives over the group, forward and backward, without recompute: what ``for_tensor``
    added to ``p``'s blocks to make ``cut`` (its sums; under sequence parallel its gathers again and its
    whole gradients' sums too)."""
    return sum(c.forward_s + c.backward_s - (b.forward_s + b.backward_s) / tp for b, c in zip(p.blocks, cut.blocks))


def _cut(b: BlockProfile, tp: int, bps: float, whole: int, routed: int, sequence: bool, summed: int) -> BlockProfile:
    one = all_reduce_s(b.hidden_bytes, tp, bps)
    whole = min(whole, b.params)
    experts = sequence and routed > 1  # a mixture run whole between the slices (``TensorPlan.sequence_whole``)
    if not sequence:
        kept = min(b.act_bytes, WHOLE_INPUTS * b.hidden_bytes)
    else:  # all sliced but a mixture's gathered input, kept by its router and each routed expert
        kept = min(b.act_bytes, (1 + routed) * b.hidden_bytes) if experts else 0
    extra = routed - 1
    gather = 0.5 * experts  # the mixture's input gathered forward, beside attention's gather and scatter
    # sequence parallel: a recompute gathers, scatters and gathers again (1.5 sums); backward gathers the
    # column layers' inputs again (an all-gather: half a sum each; a mixture gathers its output's gradient in
    # place of the MLP's) and sums each whole parameter's gradient (fp32 at most) over the group
    again, grads = (0.5 * one, all_reduce_s(4 * summed, tp, bps) + REGATHERS * 0.5 * one) if sequence else (0.0, 0.0)
    return dataclasses.replace(
        b, params=-(-(b.params - whole) // tp) + whole, largest=-(-b.largest // tp),
        forward_s=b.forward_s / tp + (FORWARD_SUMS + extra + gather) * one,
        backward_s=b.backward_s / tp + (BACKWARD_SUMS + extra) * one + grads,
        recompute_s=b.recompute_seconds / tp + (RECOMPUTE_SUMS + (routed if routed > 1 else 0)) * one + again, flops=b.flops / tp,
        traffic_bytes=b.traffic_bytes / tp, act_bytes=kept + -(-(b.act_bytes - kept) // tp),
        hidden_bytes=-(-b.hidden_bytes // tp) if sequence else b.hidden_bytes)  # a slice: what recompute keeps,
    #                                                                          and what crosses between stages
