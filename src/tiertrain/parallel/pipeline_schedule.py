"""The schedule a pipelined layout runs: torch's own (``torch.distributed.pipelining``) for GPipe, 1F1B
and interleaved 1F1B, and FOLD3D's AIAO as an action list loaded into torch's runtime schedule, all over
torch's ``PipelineStage`` objects: their sends, receives and backward are torch's.

Each stage's module is tiered by tiertrain (its own runtime, accumulating the schedule's micro-batches:
one autograd backward per micro-batch, as torch's stages run it), so the gradient reductions over the
stage's data-parallel group run inside that runtime as the last micro-batch's backward makes each
block's gradients, and ``REDUCE_GRAD`` (which torch's lowering places right after a stage's last
backward) finds them issued. Gradients are not scaled by the schedule (``scale_grads=False``): the
loss of each micro-batch is divided by their count, as a one-process loop accumulating them does, so
a pipelined step computes what that loop computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    _PipelineContext, _PipelineScheduleRuntime)

from tiertrain.parallel.aiao import REDUCE_GRAD, aiao_orders
from tiertrain.plan.pipeline import PipelineLayout

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Synced = Callable[[int], None]  # told each stage whose gradients' DP.sync has been issued (REDUCE_GRAD)


class AIAOSchedule(_PipelineScheduleRuntime):
    """FOLD3D's AIAO order (``parallel.aiao``) on torch's runtime schedule; ``on_sync(stage)`` is called
    at each stage's ``REDUCE_GRAD``, the point FOLD3D issues its DP.sync."""

    def __init__(self, stages: list[PipelineStage], layout: PipelineLayout, loss_fn: LossFn,
                 on_sync: Synced | None = None) -> None:
        super().__init__(stages=stages, n_microbatches=layout.micro_batches, loss_fn=loss_fn, scale_grads=False)
        # compute only: torch's lowering adds the sends and receives, and REDUCE_GRAD where aiao_order has it
        self.pipeline_order = {r: [a for a in acts if a.computation_type != REDUCE_GRAD]
                               for r, acts in aiao_orders(layout.pp, layout.segments, layout.micro_batches).items()}
        self._prepare_schedule_with_comms(self.pipeline_order)
        self.register_custom_function(REDUCE_GRAD, self._synced)
        self._on_sync = on_sync

    def _synced(self, action, ctx: _PipelineContext) -> None:
        if self._on_sync is not None:
            self._on_sync(action.stage_index)


class Inbox(Protocol):
    """Where a segment's first stage receives its inputs ahead of their forward (``runtime.segment_inbox``)."""

    def recv_ops(self, infos: tuple, micro: int, peer_of: Callable[[int], int]) -> list[dist.P2POp]: ...
    def take(self, infos: tuple, micro: int) -> None: ...
    def taken(self, infos: tuple) -> None: ...
    def drop(self) -> None: ...


@dataclass(frozen=True)
class Handoff:
    """FOLD3D's inter-segment lazy communication for one stage (§4): ``host_group`` (gloo) where the stage is
    a segment's last and sends its outputs to the next segment from host memory; ``inbox`` where it is a
    segment's first and takes them into host memory until its forward. Neither: torch's sends and receives."""

    host_group: dist.ProcessGroup | None = None
    inbox: Inbox | None = None


class TieredStage(PipelineStage):
    """Torch's stage over a tiered stage module, telling the module's host stashes (``offload_hidden``) which
    micro-batch runs: a forward's stashed activation checkpoints are tagged with its micro-batch, and as each
    backward ends the next micro-batch's start coming back (FOLD3D §4's prefetch, one micro-batch ahead:
    every schedule here runs a stage's backwards in micro-batch order; started after, not before, the
    backward, so at most one micro-batch's copies wait beside the one computing). Torch's stage has no hook
    for either."""

    def __init__(self, module: nn.Module, index: int, n_stages: int, device: torch.device, micro_batches: int,
                 handoff: Handoff | None = None, **kwargs) -> None:
        super().__init__(module, index, n_stages, device, **kwargs)
        self._micro_batches = micro_batches
        self._handoff = handoff or Handoff()

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.stage_index_to_group_rank[stage])

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:  # type: ignore[override]
        inbox = self._handoff.inbox
        if inbox is None:
            return super().get_fwd_recv_ops(fwd_chunk_id)
        return inbox.recv_ops(self.args_recv_info[fwd_chunk_id], fwd_chunk_id, self._peer)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:  # type: ignore[override]
        group = self._handoff.host_group
        if group is None:
            return super().get_fwd_send_ops(fwd_chunk_id)
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        return [dist.P2POp(dist.isend, out.detach().to("cpu"), self._peer(dst), group)
                for idx, out in enumerate(outputs) for dst in self.act_send_info[idx] if dst is not None]

    def _stashes(self) -> list:
        runtime = getattr(self.submod, "runtime", None)
        return list(runtime.stashes.values()) if runtime is not None else []

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):  # type: ignore[override]
        if self._handoff.inbox is not None:
            self._handoff.inbox.take(self.args_recv_info[fwd_chunk_id], fwd_chunk_id)
        stashes = self._stashes()
        for stash in stashes:
            stash.micro = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            for stash in stashes:
                stash.micro = None
            if self._handoff.inbox is not None:
                self._handoff.inbox.taken(self.args_recv_info[fwd_chunk_id])

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):  # type: ignore[override]
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if bwd_chunk_id + 1 < self._micro_batches:
            for stash in self._stashes():
                stash.prefetch(bwd_chunk_id + 1)
        return out

    def clear_runtime_states(self) -> None:
        """Torch's, at every step's start; and the stashes' tags of the last step (its first micro-batch's
        are never prefetched, and a step that raised leaves others)."""
        super().clear_runtime_states()
        for stash in self._stashes():
            stash.new_step()
        if self._handoff.inbox is not None:
            self._handoff.inbox.drop()


def stages_for(modules: list[nn.Module], indices: list[int], layout: PipelineLayout, group, device: torch.device,
               inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               handoffs: list[Handoff] | None = None) -> list[PipelineStage]:
    """Torch's stage objects over this rank's (tiered) stage modules, told their inputs' and outputs' shapes
    (meta tensors of one micro-batch), so no stage runs a forward to infer them: a tiered block's forward
    moves states, and the schedule's first step would start with one nobody asked for."""
    handoffs = handoffs or [Handoff()] * len(modules)
    return [TieredStage(m, v, layout.stages, device, layout.micro_batches, h, input_args=i, output_args=o,
                        group=group) for m, v, i, o, h in zip(modules, indices, inputs, outputs, handoffs)]


def crosses_segments(layout: PipelineLayout, stage: int) -> tuple[bool, bool]:
    """Whether ``stage`` sends its outputs to the next segment, and whether it receives them from the last
    (AIAO only: there they wait for the rest of the segment's forward; FOLD3D's lazy communication)."""
    if layout.schedule != "aiao" or layout.pp == 1:
        return False, False
    return stage % layout.pp == layout.pp - 1 and stage < layout.stages - 1, stage % layout.pp == 0 and stage > 0


def schedule_for(stages: list[PipelineStage], layout: PipelineLayout, loss_fn: LossFn,
                 on_sync: Synced | None = None):
    """The schedule object whose ``step`` runs one optimizer step's micro-batches through the stages."""
    m = layout.micro_batches
    if layout.schedule == "aiao":
        return AIAOSchedule(stages, layout, loss_fn, on_sync)
    if layout.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[layout.schedule]
    return single(stages[0], m, loss_fn=loss_fn, scale_grads=False)

