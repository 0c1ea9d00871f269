"""Expert parallelism (ANGEL-PTM §6.4, Elixir's MoE case): a mixture-of-experts layer's experts are
divided over a group of ``ep`` ranks, each holding ``n_experts / ep`` of them whole, and every token
travels to the rank of each expert it is routed to and back, by all-to-all.

Ranks ``[k*ep, (k+1)*ep)`` form expert group ``k``; the rank ``r`` holds experts
``[(r % ep) * n/ep, (r % ep + 1) * n/ep)``. With ``ep < dp`` the ``dp/ep`` ranks holding the same
experts (one per expert group, ``r % ep`` alike) are its replicas: they sum their gradients of them.

One exchange per layer and pass: the token counts per expert (all-to-all), the tokens grouped by
the rank of their expert, in expert order (all-to-all), each held expert run once per sending rank
(so each run sees exactly the rows one rank's batch routed to it, as a one-process run on that batch
does), and the outputs sent back the same way. In backward the two all-to-alls run reversed
(``_Exchange``). Every rank calls them in every layer, whatever it routed, so the ranks' collectives
stay in one order; backward reaches both exchanges on every rank (the returned outputs are always
used, and what is sent back always depends on what was received).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tiertrain.errors import ConfigError
from tiertrain.parallel.collectives import Collectives
from tiertrain.parallel.expert_layer import ExpertLayer, expert_layers
from tiertrain.parallel.local import LocalCollectives
from tiertrain.parallel.mesh import mesh_collectives


class ExpertParallel:
    """This rank's part: which experts it holds, and the ranks it exchanges tokens with (``a2a``) and
    sums its experts' gradients with (``replicas``; a world of one when ``ep`` is every rank)."""

    def __init__(self, a2a: Collectives, replicas: Collectives, dp: int, n_experts: int) -> None:
        self.a2a, self.replicas, self.dp, self.n_experts = a2a, replicas, dp, n_experts
        self.ep, self.ep_rank = a2a.world_size, a2a.rank
        self.sent = 0  # bytes of tokens (and their gradients) this rank sent to other ranks

    def owned(self, n_experts: int) -> range:
        per = n_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    def hold_own(self, model: nn.Module, params: list[nn.Parameter], replaced: dict[int, nn.Parameter]) -> set[int]:
        """Each of the model's expert layers keeps the experts this rank holds and exchanges tokens for the
        rest. The ids of ``params`` (the model's, as they were) this rank does not hold: the other ranks'
        experts, let go of (``replaced``: the originals this rank's build took the place of)."""
        for m in expert_layers(model):
            m.keep_experts(self.owned(m.n_experts), self)
        held = {id(p) for p in model.parameters()} | set(replaced)
        return {id(p) for p in params if id(p) not in held}

    def __call__(self, moe: ExpertLayer, tokens: torch.Tensor,
                 rows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The ``ExpertExchange`` of ``moe``: each expert's outputs on ``tokens[rows[e]]``."""
        per = moe.n_experts // self.ep
        counts = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        got = torch.empty_like(counts)  # got[src * per + j]: rows rank src sends to this rank's expert j
        self.a2a.host.all_to_all(got, counts)  # host memory: the splits are Python ints on every backend
        sends = counts.view(self.ep, per).sum(1).tolist()
        recvs = got.view(self.ep, per).sum(1).tolist()
        picked = [tokens.index_select(0, r) for r in rows if r.numel()]
        send = torch.cat(picked) if picked else tokens[:0]
        recv = self._exchange(send, recvs, sends)
        outs = self._run_held(moe, recv, got.tolist())
        back = self._exchange(torch.cat(outs) if outs else recv[:0], sends, recvs)
        pieces = iter(back.split([r.numel() for r in rows if r.numel()]))
        return [_Fresh.apply(next(pieces)) if r.numel() else None for r in rows]

    def _run_held(self, moe: ExpertLayer, recv: torch.Tensor, got: list[int]) -> list[torch.Tensor]:
        """The held experts on what each rank sent them, one run per (rank, expert), in arrival order."""
        segments, outs = recv.split(got), []
        for k, seg in enumerate(segments):
            if seg.numel():
                expert = moe.expert(moe.owned.start + k % len(moe.owned))
                outs.append(_Fresh.apply(expert(_Fresh.apply(seg))))
        return outs

    def _exchange(self, inp: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        before = self.a2a.sent
        out = _Exchange.apply(inp, self, out_rows, in_rows)
        self.sent += self.a2a.sent - before
        return out


class _Exchange(torch.autograd.Function):
    """An all-to-all of rows (``in_rows[r]`` to rank ``r``, ``out_rows[r]`` from it) whose backward
    sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, ep: ExpertParallel, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        ctx.ep, ctx.rows = ep, (out_rows, in_rows)
        out = inp.new_empty((sum(out_rows), *inp.shape[1:]))
        ep.a2a.all_to_all(out, inp.contiguous(), out_rows, in_rows)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_rows, in_rows = ctx.rows
        back = grad.new_empty((sum(in_rows), *grad.shape[1:]))
        before = ctx.ep.a2a.sent
        ctx.ep.a2a.all_to_all(back, grad.contiguous(), in_rows, out_rows)
        ctx.ep.sent += ctx.ep.a2a.sent - before
        return back, None, None, None


class _Fresh(torch.autograd.Function):
    """A copy in memory of its own, both ways: an expert (or the combine) reads a slice of an exchange
    buffer as it would read the tensor a one-process run makes (aligned where torch allocates), so no
    kernel's rounding can depend on where the slice starts."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone(memory_format=torch.contiguous_format)


def expert_layers_for(model: nn.Module, ep: int) -> list[ExpertLayer]:
    """The model's mixture-of-experts layers, which expert parallel (``ep`` > 1) needs; one message if none."""
    layers = expert_layers(model)
    if ep > 1 and not layers:
        raise ConfigError(f"expert parallel (ep={ep}) divides a mixture of experts' experts over ranks, but this "
                          "model has no mixture-of-experts layer (parallel.expert_layer.ExpertLayer); use a model "
                          "with n_experts > 0, or leave ep at 1")
    return layers


def apply_expert_parallel(world: Collectives, dp: int, ep: int, model: nn.Module) -> ExpertParallel | None:
    """Expert parallel applied to a run laid out with ``ep`` (None for ``ep`` = 1): its groups of ranks,
    checked against the model: it must have mixture-of-experts layers, alike, whose expert count ``ep``
    divides. The layers keep their experts once the run is built (``ExpertParallel.hold_own``)."""
    if ep == 1:
        return None
    layers = expert_layers_for(model, ep)
    n = layers[0].n_experts
    if any(m.n_experts != n for m in layers):
        raise ConfigError(f"expert parallel divides every layer's experts alike, but the model's layers hold "
                          f"{sorted({m.n_experts for m in layers})} experts; give each layer as many")
    if n % ep:
        raise ConfigError(f"ep={ep} does not divide the model's {n} experts; choose ep among "
                          f"{', '.join(str(k) for k in range(1, n + 1) if n % k == 0 and dp % k == 0)}")
    if world.world_size != dp:
        raise ConfigError(f"the plan is laid out for {dp} ranks but this run has {world.world_size}")
    if ep == dp:
        return ExpertParallel(world, LocalCollectives(), dp, n)
    a2a, replicas = _subgroups(world, dp, ep)
    return ExpertParallel(a2a, replicas, dp, n)


def _subgroups(world: Collectives, dp: int, ep: int) -> tuple[Collectives, Collectives]:
    """This rank's expert group (``ep`` consecutive ranks) and replica group (the ranks across the expert
    groups holding the same experts): a (dp/ep) x ep mesh of the run's ranks."""
    return mesh_collectives(world, dp // ep, ep, ("replicas", "experts"))
