"""FOLD3D's inter-segment lazy communication (§4): under AIAO every micro-batch of a segment runs forward
before the next segment starts, so the outputs the last stage of segment k sends to the first stage of
segment k + 1 wait there for most of the forward pass, M of them. Here they wait in the receiver's host
memory: the sender copies each output to the host and sends it over the pipeline's gloo group, the
receiver takes it into a chunk of its host pool (``Kind.ACTIVATION``: the memory system knows where it
is, on a CPU machine too), and only as that micro-batch's forward begins is it copied to the device.

Why by hand: torch's ``PipelineStage`` receives every micro-batch into a device buffer it allocates up
front; it has no notion of a buffer that waits elsewhere. A received input the host pool has no room
for is received into a host tensor of its own, outside the pools (counted: ``kept``). The stage
(``parallel.pipeline_schedule.TieredStage``) asks the inbox for its receives and hands inputs over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tiertrain.errors import BudgetError
from tiertrain.memory import Kind, MemorySystem, Tier
from tiertrain.memory.chunk import Chunk


@dataclass
class SegmentInbox:
    """The inputs a segment's first stage received ahead of their forward, in host chunks by micro-batch."""

    mem: MemorySystem
    group: dist.ProcessGroup            # the pipeline's ranks over gloo (host tensors)
    device: torch.device
    held: dict[int, list[tuple[int, Chunk | None, torch.Tensor]]] = field(default_factory=dict)  # micro -> inputs
    received: int = 0                   # over the run: inputs received into the host pool
    kept: int = 0                       # over the run: inputs received beside it (no room in the pool)
    most_held: int = 0                  # the most inputs waiting at once

    def recv_ops(self, infos: tuple, micro: int, peer_of) -> list[dist.P2POp]:
        """The receives of micro-batch ``micro``'s inputs (torch's ``_RecvInfo``s, ``peer_of(stage)`` the
        sender's global rank): into host chunks where the pool has room."""
        ops = []
        for arg, info in enumerate(infos):
            if info.is_root_arg or info.buffer is None:
                continue
            chunk, view = self._host_buffer(info.buffer)
            info.buffer = _shell(info.buffer)  # torch's device buffer for it let go: nothing waits on the device
            self.held.setdefault(micro, []).append((arg, chunk, view))
            self.received += chunk is not None
            self.kept += chunk is None
            ops.append(dist.P2POp(dist.irecv, view, peer_of(info.source), self.group))
        self.most_held = max(self.most_held, sum(map(len, self.held.values())))
        return ops

    def take(self, infos: tuple, micro: int) -> None:
        """Micro-batch ``micro``'s forward begins: its inputs copied to the device as torch's buffers, their
        host chunks freed."""
        for arg, chunk, view in self.held.pop(micro, []):
            info = infos[arg]
            info.buffer = view.to(self.device, copy=True)  # a leaf of its own: torch makes it the input
            if chunk is not None:
                self.mem.release(chunk)

    def taken(self, infos: tuple) -> None:
        """That forward ran: autograd holds the inputs it needs (torch's forward cache, until backward); the
        buffers let go, so the device holds no micro-batch's input before or after its own use."""
        for info in infos:
            if not info.is_root_arg and info.buffer is not None and not info.buffer.is_meta:
                info.buffer = _shell(info.buffer)

    def drop(self) -> None:
        """A step that raised leaves inputs never taken: their chunks freed."""
        for held in self.held.values():
            for _, chunk, _ in held:
                if chunk is not None:
                    self.mem.release(chunk)
        self.held.clear()

    def _host_buffer(self, like: torch.Tensor) -> tuple[Chunk | None, torch.Tensor]:
        """A host chunk's view shaped as ``like``; a host tensor outside the pools where it has no room (the
        sender sends from host memory over gloo, which receives into host memory only)."""
        nbytes = like.numel() * like.element_size()
        try:
            chunk = self.mem.allocate("segment.input", max(nbytes, 1), Tier.HOST, Kind.ACTIVATION, contiguous=True)
        except BudgetError:
            return None, torch.empty(like.shape, dtype=like.dtype)
        return chunk, chunk.typed(like.dtype)[: like.numel()].view(like.shape)


def _shell(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype holding no memory (what torch's stage reads of a buffer it has not
    been handed yet)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")
