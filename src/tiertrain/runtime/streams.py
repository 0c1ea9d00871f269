"""STRONGHOLD's multi-streamed execution inside one device (its "Multi-streamed GPU Execution"): a block's
batch split into S chunks, each chunk's forward issued on a CUDA stream of its own, so the device runs the
chunks side by side where one stream would leave it idle (kernels too small to fill it, a stream stalled
on a copy). One copy of the block's parameters serves every chunk (STRONGHOLD's point against replicas),
and the chunks' gradients meet where autograd sums them: a weight's S contributions are added in one
order, chunk by chunk, whichever stream made them (CUDA's rule: a backward op runs on its forward's
stream, and autograd waits across streams where one consumes another's result). So S streams give the
bits S chunks give on one stream; against the whole batch at once, the batch's matmuls sum in another
order (a tolerance, as any data parallel).

Written by hand: torch has data parallel over devices (DistributedDataParallel, the deprecated
DataParallel), none over streams of one device with one copy of the weights. Only the chunking and the
stream order are here; a block's runtime hooks (fetch, gradients) fire once per block, as without
streams, since the chunks call the module's forward, not the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from tiertrain.errors import ConfigError


class Streams(Protocol):
    """Where chunk ``i``'s work is issued, and the order between it and the step's stream."""

    def fork(self, i: int) -> None: ...          # chunk i's stream waits for the step's work so far
    def side(self, i: int) -> AbstractContextManager[Any]: ...  # work issued inside goes to chunk i's stream
    def keep(self, t: torch.Tensor, i: int) -> None: ...  # t, made on the step's stream, is read on chunk i's
    def join(self, i: int) -> None: ...          # the step's stream waits for chunk i's work


class OneStream:
    """Every chunk on the step's own stream (a CPU, where work runs as it is issued): the chunks one after
    the other, the order multi-stream runs are checked against."""

    def fork(self, i: int) -> None:
        pass

    def side(self, i: int) -> AbstractContextManager[Any]:
        return nullcontext()

    def keep(self, t: torch.Tensor, i: int) -> None:
        pass

    def join(self, i: int) -> None:
        pass


class CudaStreams:
    """Chunk ``i`` on the i-th of ``n`` streams of the current device (made once per block)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self._streams = [torch.cuda.Stream(device) for _ in range(n)]

    def fork(self, i: int) -> None:
        self._streams[i].wait_stream(torch.cuda.current_stream())

    def side(self, i: int) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._streams[i])

    def keep(self, t: torch.Tensor, i: int) -> None:
        t.record_stream(self._streams[i])  # its memory not reused by the step's stream before chunk i read it

    def join(self, i: int) -> None:
        torch.cuda.current_stream().wait_stream(self._streams[i])


_MADE: dict[tuple[int | None, int], CudaStreams] = {}


def streams_for(n: int, device: torch.device) -> Streams:
    """CUDA streams on a GPU, one set of ``n`` per device that every block shares (torch hands streams out
    round-robin from a small pool that its collectives and tiertrain's copy streams draw from too: a set per
    block would soon share one with them); on a CPU the chunks in turn (there are no streams there)."""
    if device.type != "cuda":
        return OneStream()
    key = (device.index, n)
    if key not in _MADE:
        _MADE[key] = CudaStreams(n, device)
    return _MADE[key]


def in_streams(forward: Callable[..., Any], n: int, streams: Streams) -> Callable[..., Any]:
    """``forward`` (a block's) run as ``n`` chunks of its batch (dim 0 of its first tensor argument), chunk
    ``i`` on ``streams``' i-th stream, the outputs joined in chunk order. Every argument of two or more
    dimensions with that many rows (hidden states, a per-row mask, per-row positions and their rotary
    tables, also inside a tuple) is split alike; any other (a mask or positions shared by the rows, a 1-D
    cache position, which may have as many entries as there are rows by chance) goes whole to each chunk. A
    batch of fewer rows than streams (an evaluation, one sequence) runs a row per chunk."""
    def chunked(*args: Any, **kwargs: Any) -> Any:
        rows = _rows(args, kwargs)
        parts = min(n, rows)
        outs = []
        for i, (a, k) in enumerate(_chunks(args, kwargs, rows, parts)):
            streams.fork(i)
            for t in _tensors(a, k):
                streams.keep(t, i)
            with streams.side(i):
                outs.append(forward(*a, **k))
        for i in range(parts):
            streams.join(i)
        return _joined(outs)
    return chunked


def _rows(args: tuple, kwargs: dict) -> int:
    """The rows of the hidden states (the first tensor of two or more dimensions). Where they equal its
    sequence length, a (sequence, ...) table or mask among the other arguments would look like rows: refused."""
    tensors = [t for t in _tensors(args, kwargs) if t.dim() > 1]
    if not tensors:
        raise ConfigError("a block run over several streams takes a batch of hidden states as an argument: none was "
                          "given")
    rows = tensors[0].shape[0]
    if rows == tensors[0].shape[1] and any(t.shape[0] == rows for t in tensors[1:]):
        raise ConfigError(f"a block over several streams got {rows} rows of {rows} tokens and another argument of "
                          f"{rows} along its first dimension: whether it is per row or per token cannot be told; give "
                          "batches whose rows differ from the sequence length, or run it on one stream (\"streams\": 1)")
    return rows


def _tensors(args: Any, kwargs: dict | None = None) -> Iterator[torch.Tensor]:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, tuple):
            yield from _tensors(a)


def _chunks(args: tuple, kwargs: dict, rows: int, n: int) -> Iterator[tuple[tuple, dict]]:
    def split(a: Any) -> list[Any]:
        if isinstance(a, torch.Tensor) and a.dim() > 1 and a.shape[0] == rows:
            return list(torch.tensor_split(a, n))
        if isinstance(a, tuple):
            return [tuple(part) for part in zip(*(split(x) for x in a))] if a else [a] * n
        return [a] * n
    parts = [split(_no_cache(f"argument {i + 1}", a)) for i, a in enumerate(args)]
    named = {k: split(_no_cache(k, v)) for k, v in kwargs.items()}
    for i in range(n):
        yield tuple(p[i] for p in parts), {k: v[i] for k, v in named.items()}


def _no_cache(name: str, value: Any) -> Any:
    """A transformers key/value cache given to the block (by keyword, as Llama does, or by position, as GPT-2
    does): each chunk would append its rows' keys where the next chunk reads them as its past. An empty one (a training forward, which never reads it back) is
    left out of the chunks' calls, and stays empty; one holding keys (generation) is refused."""
    if not hasattr(value, "get_seq_length"):
        return value
    if value.get_seq_length() == 0:
        return None
    raise ConfigError(f"a block over several streams was given a key/value cache ({name}) holding keys: generate on one "
                      "stream (\"streams\": 1), or call the model with use_cache=False")


def _joined(outs: list[Any]) -> Any:
    """The chunks' outputs as the whole batch's: tensors concatenated along their rows; a tuple or list of
    them element by element (None stays None); anything else refused."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, (tuple, list)) and all(isinstance(o, type(first)) and len(o) == len(first) for o in outs):
        return type(first)(_joined(list(parts)) if parts[0] is not None else None for parts in zip(*outs))
    raise ConfigError(f"a block run over several streams returned a {type(first).__name__}: only tensors and tuples "
                      "of them are joined; run this model's blocks on one stream (\"streams\": 1)")
