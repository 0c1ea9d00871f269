"""A model cut in place by its parallelize plan (``parallel.tensor_plans``): every rank of the group starts
from one whole model (``parallel.tensor_start``), and each block's linear layers the plan names are
replaced by this rank's column- or row-parallel shard of them (``parallel.tensor_layers``)."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import nn

from tiertrain.errors import ConfigError
from tiertrain.models.gpt import GPT
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.sequence_ops import (
    enter_sequence,
    gather_sequence,
    scatter_sequence,
)
from tiertrain.parallel.tensor_layers import column_parallel, row_parallel
from tiertrain.parallel.tensor_ops import enter_region
from tiertrain.parallel.tensor_plans import (
    TensorPlan,
    check_sequence_parallel,
    check_tensor_parallel,
)
from tiertrain.parallel.tensor_start import (
    back_to_meta,
    drawn_whole,
    group_seed,
    same_start,
)


def parallelize(model: nn.Module, rank: int, group: Collectives, sequence: bool = False) -> dict[int, nn.Parameter]:
    """Cut ``model``'s blocks in place into this rank's shards, every rank of ``group`` from the same whole
    model (``sequence``: each rank holding its slice of the sequence between the cut regions); returns
    each replaced parameter's new one by the old one's ``id`` (an optimizer built over the whole model is
    pointed at them)."""
    plan = check_tensor_parallel(model, group.world_size)
    if sequence:
        check_sequence_parallel(model, plan)
    if not isinstance(model, GPT) and any(b.is_meta for b in model.buffers()):
        raise ConfigError(f"a {type(model).__name__} built on the meta device cannot be cut over tensor-parallel "
                          "ranks yet (its buffers, as rotary frequencies, are not drawn): build it in memory "
                          "(a larger --host-memory)")
    seed = group_seed(group)
    same_start(model, group, seed, plan.blocks_at)
    new_of = parallelize_blocks(plan, plan.blocks(model), rank, group, seed, sequence=sequence)
    if sequence:
        slice_sequence(model, plan, group)
    return new_of


def slice_sequence(model: nn.Module, plan: TensorPlan, group: Collectives, first: bool = True,
                   last: bool = True) -> None:
    """Sequence parallel's two ends (``plan.sequence_at``): the first block's input cut into slices over
    ``group``, and the input of what follows the blocks put together again. A pipeline stage installs the
    ends it holds (``first``: the model's first block, ``last``: the final norm); a later stage of a model
    that builds what its blocks read from its input's length (``plan.length_before_blocks``) gathers the
    slices it receives whole and slices them again as its first block begins (its causal mask and rotary
    tables built for the whole sequence, as the first stage builds them); a stage before the last of a model
    whose base views its blocks' output to its input's length (``plan.views_after_blocks``: GPT-2) gathers
    its output whole where the final norm would be, and hands on its slice again."""
    begin, end = plan.sequence_at
    later = not first and plan.length_before_blocks
    if later:
        model.register_forward_pre_hook(_entered(group, gather_sequence), with_kwargs=True)
    if first or later:  # (a stage's blocks are under the model's indices: its first by position)
        start = operator.attrgetter(begin)(model) if first else plan.blocks(model)[0]
        start.register_forward_pre_hook(_entered(group, scatter_sequence), with_kwargs=True)
    if last:
        operator.attrgetter(end)(model).register_forward_pre_hook(_entered(group, gather_sequence), with_kwargs=True)
    elif plan.views_after_blocks:  # a stage before the last whose base views its output to the whole length:
        model.handoff.register_forward_pre_hook(_entered(group, gather_sequence), with_kwargs=True)  # whole there,
        model.register_forward_hook(_sliced(group))  # then the stage hands on its slice (``hf_stages.DecoderStage``)


def parallelize_blocks(plan: TensorPlan, blocks: nn.ModuleList, rank: int, group: Collectives, seed: int,
                       first: int = 0, sequence: bool = False) -> dict[int, nn.Parameter]:
    """``parallelize`` of some of a checked model's blocks (a pipeline stage's: ``first`` is the index of
    its first block in the model), each alike on every rank of ``group`` already but for its matrices on
    the meta device, drawn whole here from ``seed`` one block at a time (the cut ones let go again once
    cut; a whole one, as a router, kept: setup would draw it from each rank's own generator)."""
    new_of: dict[int, nn.Parameter] = {}
    for j, block in enumerate(blocks):
        cuts = [(path, cut) for path, _ in block.named_modules() if (cut := plan.cut_at(path)) is not None]
        if not cuts:
            raise ConfigError(f"block {first + j} has none of the layers its tensor-parallel plan cuts "
                              f"({', '.join(c.path for c in plan.cuts)}): the model is not laid out as its type's")
        for path, cut in cuts:
            parent_path, _, attr = path.rpartition(".")
            parent = operator.attrgetter(parent_path)(block) if parent_path else block
            linear = getattr(parent, attr)
            drawn = [p for p in linear.parameters() if p.is_meta]
            for pname, p in linear.named_parameters():
                if p.is_meta:
                    drawn_whole(f"{plan.blocks_at}.{first + j}.{path}.{pname}", p, seed)
            split = plan.weight_split(cut)
            sliced = sequence and not plan.in_whole(path)  # (in a module run whole: cut as without slices)
            enters = not (plan.sequence_inputs if sliced else plan.shared_inputs)
            new = (column_parallel(linear, split, rank, group, enters, plan.transposed)
                   if cut.column else row_parallel(linear, split, rank, group, plan.transposed, sliced))
            for pname, p in linear.named_parameters():
                new_of[id(p)] = getattr(new, pname)
            for p in drawn:
                back_to_meta(p)
            setattr(parent, attr, new)
        for name, p in block.named_parameters():  # a whole one still on meta (a router) drawn alike, not by setup
            if p.is_meta:
                drawn_whole(f"{plan.blocks_at}.{first + j}.{name}", p, seed)
        paths, enter = (plan.sequence_inputs, enter_sequence) if sequence else (plan.shared_inputs, enter_region)
        for path in paths:
            operator.attrgetter(path)(block).register_forward_pre_hook(_entered(group, enter), with_kwargs=True)
        for path in plan.sequence_whole if sequence else ():
            whole = operator.attrgetter(path)(block)
            whole.register_forward_pre_hook(_entered(group, gather_sequence), with_kwargs=True)
            whole.register_forward_hook(_sliced(group))
        for heads in plan.heads_attrs:
            owner_path, _, attr = heads.rpartition(".")
            owner = operator.attrgetter(owner_path)(block)
            setattr(owner, attr, getattr(owner, attr) // group.world_size)
    return new_of


Enter = Callable[[torch.Tensor, Collectives], torch.Tensor]


def _sliced(group: Collectives) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]:
    """A hook handing each rank its slice of the sequence of a module's output, whole and alike on every rank
    of ``group`` (a mixture of experts run whole: each expert's partial outputs summed over the group)."""
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(out, group)
    return hook


def _entered(group: Collectives, enter: Enter = enter_region) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """A pre-hook entering a module's input (its first argument, or ``hidden_states``) into the cut region
    once, for every column-parallel layer reading it (``enter``: ``enter_region``, or ``enter_sequence``
    gathering a rank's sequence slice); with ``scatter_sequence`` or ``gather_sequence``, where the
    blocks' sequence is sliced and put together again."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (enter(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"], group)}
    return hook
