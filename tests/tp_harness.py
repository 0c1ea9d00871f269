"""Tensor-parallel runs for the tests (issue 39): every configuration trained in one set of spawned gloo
ranks, against one process of plain PyTorch on the same batches (pp_harness's reference: over
data-parallel replicas, their gradients averaged as DDP does) with the same fused AdamW."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
from dp_harness import rank_disk
from pp_harness import TINY, _plan, batches, config_of, fresh, loss_of

STATES = ("master", "exp_avg", "exp_avg_sq")
META_SEED = 1234


@dataclasses.dataclass(frozen=True)
class TpCase:
    tp: int
    plan: str = "stream"         # "stream": states on the host, blocks streamed; "disk": homed on disk; "stash"
    clip: float | None = None    # clipped by the loop's torch.nn.utils.clip_grad_norm_
    update: str = "sync"
    staleness: int | None = None  # lockfree's max staleness (None: the plan's)
    tied: bool = False
    skew: bool = False           # each rank's model drawn otherwise (ranks seeded apart): rank 0's must win
    meta: bool = False           # the model built on the meta device: drawn by the group, alike
    sequence: bool = False       # sequence parallel: each rank its slice of the sequence between cut regions
    ep: int = 1                  # expert parallel: each MoE layer's experts divided over this many replicas
    shard_group: int = 0         # hybrid sharding: the blocks sharded over groups of this many replicas
    family: str = "gpt"          # "gpt": tiertrain's; "moe": with experts; "llama" (GQA: 4 heads, 2 key-value),
    #                              "qwen2", "gpt2", "gpt_neox": transformers' (pp_harness.config_of)


def state_bytes(runtime) -> dict[str, int]:
    """The optimizer's states this rank holds, in every tier, from the memory system's accounting."""
    from tiertrain.plan.tiers import Kind, Tier

    return {k: sum(runtime.mem.accounting.live(t, Kind(k)) for t in Tier) for k in STATES}


def tp_losses(rank: int, case: TpCase, disk: Path, save_to: Path | None = None, load_from: Path | None = None) -> dict:
    """This rank's replica, its loss per step, the bytes its tensor-parallel group sent per step, and the
    optimizer-state bytes it holds. ``save_to``: a checkpoint after the first step; ``load_from``: the
    run starts from that checkpoint's step."""
    import tiertrain
    from tiertrain.memory import Budgets

    model, opt = fresh(case.tied, case.family)
    if case.skew and rank % case.tp:
        torch.manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
    cut: list = []
    if case.meta:  # the group's seed made known (META_SEED), each rank's own generators set apart
        import tiertrain.parallel.tensor_parallelize as plans
        from tiertrain.models import build
        from tiertrain.train.optimizer import make_adamw

        plans.group_seed = lambda group: META_SEED
        torch.manual_seed(rank)
        model = build(config_of(case.family, case.tied), device="meta")
        opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
        cut = [model.blocks[0].attn.qkv.weight]  # the whole parameter the cut replaces
    run = tiertrain.tensor_parallel(model, opt, case.tp, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)),
                                    plan=_plan(case.plan, TINY["n_layer"]), page_size=64 << 10, update=case.update,
                                    max_staleness=case.staleness, sequence_parallel=case.sequence,
                                    **({"ep": case.ep} if case.ep > 1 else {}),
                                    **({"shard_group": case.shard_group} if case.shard_group else {}))
    out = {"replica": run.mesh.dp_rank, "losses": [], "sent": [], "tp_rank": run.mesh.tp_rank,
           "let_go": [p.is_meta for p in cut]}
    if case.plan == "resident" and case.family in ("gpt", "moe"):  # the blocks' params stay in their slots: as cut
        block = run.model.blocks[0]
        out["qkv"], out["ln1"] = (t.detach().clone() for t in (block.attn.qkv.weight, block.ln1.weight))
        out["emb"] = run.model.tok_emb.weight.detach().clone()
        if case.family == "moe":
            out["router"] = block.ffn.router.weight.detach().clone()
    try:
        first = tiertrain.load_tensor_parallel(run, load_from).step if load_from is not None else 0
        for step, b in enumerate(batches(run.mesh.dp_rank)[first:], start=first):
            if save_to is not None and step == 1:
                tiertrain.save_tensor_parallel(run, save_to, step)
            before = run.mesh.tp_group.sent
            with _saved_bytes(out if case.plan == "resident" and step == first else {}):
                loss = loss_of(run.model, b[:, :-1], b[:, 1:])
            loss.backward()
            if case.clip is not None:
                out.setdefault("norms", []).append(float(torch.nn.utils.clip_grad_norm_(run.model.parameters(),
                                                                                        case.clip)))
            run.optimizer.step()
            run.optimizer.zero_grad()
            out["losses"].append([loss.item()])
            out["sent"].append(run.mesh.tp_group.sent - before)
        run.model.runtime.wait_updates()  # a lockfree loop may still hold a master it moves between the tiers
        out["states"] = state_bytes(run.model.runtime)
        out["whole"] = {k: v for k, v in run.model.state_dict().items() if "ln" in k or "norm" in k}  # never cut
        out["shapes"] = {n: tuple(p.shape) for n, p in run.model.named_parameters()}
        if case.ep > 1:  # the experts this rank holds, and the bytes of tokens it sent them
            out["experts"] = (list(run.model.blocks[0].ffn.owned), run.model.runtime.experts.sent)
        return out
    finally:
        run.close()


@contextlib.contextmanager
def _saved_bytes(out: dict):
    """Counts into ``out["saved"]`` the bytes of every tensor autograd saves for backward in the block
    (a resident plan's forward keeps its activations as autograd saves them: nothing of ours in between)."""
    if not isinstance(out, dict) or "losses" not in out:
        yield
        return
    out["saved"] = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            out["saved"] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def refused(rank: int, disk: Path, **fields) -> str:
    """What ``tiertrain.tensor_parallel`` of the test MoE model over every rank (one group, one replica) with
    ``fields`` says, refusing them (the run's ranks are a group, not data-parallel replicas)."""
    import tiertrain
    from tiertrain.errors import ConfigError
    from tiertrain.memory import Budgets

    model, opt = fresh(family="moe")
    try:
        run = tiertrain.tensor_parallel(model, opt, 2, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)),
                                        plan="stream", **fields)
    except ConfigError as exc:
        return str(exc)
    run.close()
    return "not refused"


def groups_left(rank: int, case: TpCase, disk: Path) -> int:
    """The process groups ``case``'s run left behind once closed (torch's private map of them: no public
    call counts them)."""
    import torch.distributed as dist

    before = len(dist.distributed_c10d._world.pg_map)
    tp_losses(rank, case, disk)
    return len(dist.distributed_c10d._world.pg_map) - before
