"""Pipelined runs for the tests (issue 38): every configuration trained in one set of spawned gloo ranks,
against one process of plain PyTorch accumulating the same micro-batches (and, over data-parallel
replicas, averaging their gradients as DDP does) with the same fused AdamW."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from conftest import at_one_thread
from dp_harness import rank_disk

TINY = {"n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256, "max_seq_len": 64,
        "tie_embeddings": False}
STEPS, ROWS = 3, 4


def batches(replica: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(300 + replica)
    return [torch.randint(0, 256, (ROWS, 17), generator=g) for _ in range(STEPS)]


LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 0,
         "eos_token_id": 0, "pad_token_id": 0}


GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
        "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
NEOX = {"model_type": "gpt_neox", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "max_position_embeddings": 64, "rotary_pct": 0.5}
MOE = {**TINY, "n_experts": 4, "top_k": 2}
FAMILIES = {"gpt2": GPT2, "gpt_neox": NEOX}  # and "llama", "qwen2", "mistral" alike (LLAMA's shape)


def config_of(family: str, tied: bool = False) -> dict:
    """The test model of ``family`` ("gpt": our GPT; "moe": ours with 4 experts, 2 a token)."""
    if family in ("gpt", "moe"):
        return {**(TINY if family == "gpt" else MOE), "tie_embeddings": tied}
    return {**FAMILIES.get(family, {**LLAMA, "model_type": family}), "tie_word_embeddings": tied}


def fresh(tied: bool = False, family: str = "gpt"):
    from tiertrain.models import build
    from tiertrain.train.optimizer import make_adamw

    torch.manual_seed(0)
    model = build(config_of(family, tied))
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    return model, opt


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss as a loop over the plain model computes it (our GPT's own; a transformers
    model's logits through the same mean cross-entropy the pipeline's last stage takes)."""
    from tiertrain.models.gpt import GPT, token_loss

    return model(x, y) if isinstance(model, GPT) else token_loss(model(input_ids=x).logits, y)


@at_one_thread
def reference(dp: int, micro: int, clip: float | None = None, start=None, first: int = 0,
              tied: bool = False, family: str = "gpt", norms: list | None = None) -> list[list[list[float]]]:
    """Each replica's micro-batch losses (divided by their count) per step, in one process: every replica's
    gradients accumulated over its micro-batches, averaged over the replicas (once a step, as a pipeline's
    DP.sync reduces them), clipped, one AdamW step. ``start``: (model, optimizer) to go on from, at step
    ``first`` (a resumed checkpoint's). ``norms``: each clipped step's gradient norm appended to it."""
    model, opt = start or fresh(tied, family)
    data = [batches(r) for r in range(dp)]
    out = []
    for step in range(first, STEPS):
        per_replica, grads = [], []
        for r in range(dp):
            b = data[r][step]
            losses = []
            for x, y in zip(b[:, :-1].chunk(micro), b[:, 1:].chunk(micro)):
                loss = loss_of(model, x, y) / micro
                loss.backward()
                losses.append(loss.item())
            per_replica.append(losses)
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.zero_grad()
        for k, p in enumerate(model.parameters()):  # an expert no token reached has none (AdamW skips it)
            got = [g[k] for g in grads if g[k] is not None]
            total = got[0] if got else None
            for g in got[1:]:
                total = total + g
            p.grad = total / dp if dp > 1 and total is not None else total
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        out.append(per_replica)
    return out


@at_one_thread
def tiered_reference(case: Case, disk: Path) -> list[list[list[float]]]:
    """As ``reference`` for one replica, but a tiered run in one process (``tiertrain.setup`` with the case's
    plan and compute dtype, its forward autocast as ``train``'s loop does): a bf16 run computes in bf16
    weights, which plain PyTorch under autocast does not (its embeddings stay fp32)."""
    import tiertrain
    from tiertrain.memory import Budgets

    model, opt = fresh(case.tied, case.family)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, str(disk)),
                               plan=_plan(case.plan, TINY["n_layer"]), page_size=64 << 10, update=case.update,
                               grad_accum=case.micro, compute_dtype=case.dtype, max_grad_norm=case.clip)
    out = []
    try:
        for b in batches(0):
            losses = []
            for x, y in zip(b[:, :-1].chunk(case.micro), b[:, 1:].chunk(case.micro)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.dtype == "bf16"):
                    loss = loss_of(tm, x, y) / case.micro
                loss.backward()
                losses.append(loss.item())
            topt.step()
            topt.zero_grad()
            out.append([losses])
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    schedule: str
    micro: int
    segments: int
    plan: str = "stream"           # "stream": states homed on the host, blocks streamed; "disk": homed on disk
    update: str = "sync"
    clip: float | None = None
    dtype: str = "fp32"
    tied: bool = False             # the head uses the token embedding's weight: across the first and last stage
    family: str = "gpt"            # "gpt": tiertrain's; "llama": a transformers Llama
    sequence: bool = False         # with tp: sequence parallel, the sequence sliced between stages too
    ep: int = 1                    # expert parallel: each stage's experts divided over this many replicas
    shard_group: int = 0           # hybrid sharding: each stage's blocks sharded over groups of this many replicas


def _plan(name: str, n_blocks: int):
    from tiertrain.memory import Tier
    from tiertrain.plan import BlockPlan, Plan, builtin_plan

    if name == "stash":  # every block recomputed, its input (the activation checkpoint) offloaded to the host
        base = builtin_plan("stream", n_blocks)
        return dataclasses.replace(base, blocks=tuple(dataclasses.replace(b, recompute=True, offload_hidden=True)
                                                      for b in base.blocks))
    if name == "disk":
        return Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in range(n_blocks)), BlockPlan(home=Tier.DISK),
                    name="disk-home")
    return name


def pipelined_losses(rank: int, case: Case, pp: int, disk: Path, events: bool = False, save_to: Path | None = None,
                     load_from: Path | None = None, tp: int = 1) -> dict:
    """This rank's replica index and its micro-batch losses per step; with ``events``, the order in which each
    of its stages' backward began and its gradients' reductions were issued (first step only). ``save_to``:
    a checkpoint after the first step there; ``load_from``: the steps after a checkpoint's, from it. ``tp``:
    each stage's blocks cut over that many ranks (each clipped step's norm in ``norms``)."""
    import tiertrain
    from tiertrain.api.pipeline import pipeline
    from tiertrain.memory import Budgets
    from tiertrain.plan.pipeline import PipelineLayout

    model, opt = fresh(case.tied, case.family)
    layout = PipelineLayout(pp=pp, schedule=case.schedule, micro_batches=case.micro, segments=case.segments)
    run = pipeline(model, opt, layout, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)),
                   plan=_plan(case.plan, TINY["n_layer"]), page_size=64 << 10, update=case.update,
                   max_grad_norm=case.clip, compute_dtype=case.dtype, tp=tp, sequence_parallel=case.sequence,
                   **({"ep": case.ep} if case.ep > 1 else {}),
                   **({"shard_group": case.shard_group} if case.shard_group else {}))
    log: list[tuple[str, int]] = []
    if events:
        _record(run, log)
    replica, norms, recorded = rank // (pp * tp), [], None
    try:
        losses, first = [], tiertrain.load_pipeline(run, load_from).step if load_from else 0
        sent = []  # the bytes this rank's tensor-parallel group sent a step (backward's and the norm's included)
        for step, b in enumerate(batches(replica)[first:], start=first):
            before = run.mesh.tp_group.sent if tp > 1 else 0
            run.step(b[:, :-1], b[:, 1:])
            losses.append(run.micro_losses.tolist())
            if tp > 1 and case.clip is not None:
                norms.append(float(run.optimizer.clip_grad_norm_(case.clip)))
            if events:
                log.append(("step", step))
            run.optimizer.step()
            if events:
                log.append(("stepped", step))
            run.optimizer.zero_grad()
            sent.append(run.mesh.tp_group.sent - before if tp > 1 else 0)
            if save_to is not None and step == 0:
                tiertrain.save_pipeline(run, save_to, step=1)
            if events and step == 1:
                events, recorded = False, list(log)
        out = {"replica": replica, "losses": losses, "pp_rank": run.mesh.pp_rank, "indices": run.indices, "norms": norms,
               "head_released": model.lm_head.weight.is_meta,  # no rank keeps a head it does not train
               "tp_sent": sent}
        if recorded is not None:
            out["events"] = recorded
            out["synced"] = run.synced
        return out
    finally:
        run.close()


def _record(run, log: list) -> None:
    """Log each stage's forward and backward beginning (its output's gradient arriving), each reduction its
    runtime issues over the stage's data-parallel group, each landing of one, each block's update, and each
    time a block's params were found ready for a use (tagged with the stage)."""
    for module, v in zip(run.stages, run.indices):
        module.register_forward_pre_hook(lambda m, a, v=v: log.append(("forward", v)))
        module.register_full_backward_pre_hook(lambda m, g, v=v: log.append(("backward", v)))
        for g in module.runtime.groups:
            g._land = lambda r, _land=g._land, _e=("landed", v, g.index): (r is None or log.append(_e), _land(r))
            g.update = _logged(g.update, log, ("updated", v, g.index))
            g.await_params = _logged(g.await_params, log, ("ready", v, g.index), after=True)
        comm = module.runtime.comm
        for name in ("reduce_scatter", "all_reduce"):
            inner = getattr(comm, name)

            def logged(*args, _inner=inner, _v=v, **kwargs):
                log.append(("sync", _v))
                return _inner(*args, **kwargs)
            setattr(comm, name, logged)


def _logged(call, log: list, event: tuple, after: bool = False):
    def logged(*args, **kwargs):
        if not after:
            log.append(event)
        out = call(*args, **kwargs)
        if after:
            log.append(event)
        return out
    return logged


def stage_dies(rank: int, world: int, store: str, tmp: str, errors) -> None:
    """A rank process of a pp = 2 AIAO run: one step, then rank 1 is SIGKILLed as the second begins; rank 0's
    error and how long after the kill it came are kept in ``errors``."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from tiertrain.api.pipeline import pipeline
    from tiertrain.memory import Budgets
    from tiertrain.plan.pipeline import PipelineLayout

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, opt = fresh()
    run = pipeline(model, opt, PipelineLayout(pp=2, schedule="aiao", micro_batches=2, segments=2),
                   Budgets(64 << 20, 64 << 20), plan="stream", page_size=64 << 10)
    data, began = batches(0), time.monotonic()
    try:
        run.step(data[0][:, :-1], data[0][:, 1:])
        run.optimizer.step()
        dist.barrier()
        began = time.monotonic()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        run.step(data[1][:, :-1], data[1][:, 1:])
    except BaseException as exc:  # noqa: BLE001 - rank 0's error is what the test reads
        errors[rank] = (f"{type(exc).__name__}: {exc}", time.monotonic() - began)
    finally:
        run.close()


def stashed_checkpoints(rank: int, micro: int) -> dict:
    """One AIAO step (pp = 2, 2 segments, ``micro`` micro-batches of 2 rows) with every block recomputed and
    its saved input (the activation checkpoint) offloaded: the host bytes the stages' stashes held at their
    peak, the tensors left where they were, and one checkpoint's bytes."""
    import dataclasses as dc

    from tiertrain.api.pipeline import pipeline
    from tiertrain.memory import Budgets, Kind, Tier
    from tiertrain.plan import builtin_plan
    from tiertrain.plan.pipeline import PipelineLayout

    base = builtin_plan("stream", TINY["n_layer"])
    plan = dc.replace(base, blocks=tuple(dc.replace(b, recompute=True, offload_hidden=True) for b in base.blocks))
    model, opt = fresh()
    run = pipeline(model, opt, PipelineLayout(pp=2, schedule="aiao", micro_batches=micro, segments=2),
                   Budgets(64 << 20, 64 << 20), plan=plan, page_size=64 << 10)
    try:
        b = torch.randint(0, 256, (2 * micro, 17), generator=torch.Generator().manual_seed(5))
        stashes = [st for s in run.stages for st in s.runtime.stashes.values()]
        tags = []  # the stashes' micro-batch tags left after each step: they must not pile up
        for _ in range(2):
            run.step(b[:, :-1], b[:, 1:])
            run.optimizer.zero_grad()
            tags.append(sum(len(v) for st in stashes for v in st._by_micro.values()))
        peak = sum(s.runtime.mem.accounting.peak(Tier.HOST, Kind.ACTIVATION) for s in run.stages)
        return {"peak": peak, "kept": sum(st.kept for st in stashes), "checkpoint": 2 * 16 * TINY["d_model"] * 4,
                "stashed": sum(st.stashed for st in stashes), "prefetched": sum(st.prefetched for st in stashes),
                "tags": tags}
    finally:
        run.close()


def resumed_from_one_process(rank: int, pp: int, disk: Path, out: Path, case: Case | None = None) -> dict:
    """Rank 0 trains one step in one process of plain PyTorch (``case``'s micro-batches, its model tied or not)
    and saves it as ``train`` does; every rank then resumes that checkpoint as ``case``'s pipeline (AIAO over 4
    stages unless told) and trains the other steps."""
    import torch.distributed as dist

    from tiertrain.checkpoint.run import TrainerState, save_checkpoint
    from tiertrain.checkpoint.train_state import PlainState

    case = case or Case("aiao", 4, 2)
    if rank == 0:
        model, opt = fresh(case.tied)
        names = {i: n for i, n in enumerate([n for n, p in model.named_parameters() if p.dim() >= 2]
                                            + [n for n, p in model.named_parameters() if p.dim() < 2])}
        b, m = batches(0)[0], case.micro
        for x, y in zip(b[:, :-1].chunk(m), b[:, 1:].chunk(m)):
            (model(x, y) / m).backward()
        opt.step()
        save_checkpoint(out, PlainState(model, opt, names), TrainerState(1, 0, {}, {}), keep=1)
    dist.barrier()
    return pipelined_losses(rank, case, pp, disk, load_from=out)


def segment_inbox(rank: int, micro: int, host: int = 64 << 20) -> dict:
    """Two AIAO steps (pp = 2, 2 segments, ``micro`` micro-batches of 2 rows): what the stages receiving a
    segment's outputs from the one before took into host memory (FOLD3D's lazy inter-segment hand-off), the
    host pool's activations left after each step, whether the received inputs' buffers hold no memory after
    it, and the losses. ``host``: the host budget (0: no room in the pool; the states stay on the device)."""
    from tiertrain.api.pipeline import pipeline
    from tiertrain.memory import Budgets, Kind, Tier
    from tiertrain.plan.pipeline import PipelineLayout

    model, opt = fresh()
    run = pipeline(model, opt, PipelineLayout(pp=2, schedule="aiao", micro_batches=micro, segments=2),
                   Budgets(64 << 20, host), plan="stream" if host else "resident", page_size=64 << 10)
    try:
        b = torch.randint(0, 256, (2 * micro, 17), generator=torch.Generator().manual_seed(5))
        left, losses = [], []
        for _ in range(2):
            run.step(b[:, :-1], b[:, 1:])
            losses.append(run.micro_losses.tolist())
            run.optimizer.step()
            run.optimizer.zero_grad()
            left.append(sum(s.runtime.mem.accounting.live(Tier.HOST, Kind.ACTIVATION) for s in run.stages))
        staged = [s for s in run._schedule._stages if s._handoff.inbox is not None]
        inboxes = [s._handoff.inbox for s in staged]
        buffers = [a.buffer for s in staged for infos in s.args_recv_info.values() for a in infos if not a.is_root_arg]
        return {"received": sum(i.received for i in inboxes), "kept": sum(i.kept for i in inboxes),
                "most": max((i.most_held for i in inboxes), default=0), "left": left, "losses": losses,
                "peak": sum(s.runtime.mem.accounting.peak(Tier.HOST, Kind.ACTIVATION) for s in run.stages),
                "input": 2 * 16 * TINY["d_model"] * 4, "let_go": bool(buffers) and all(t.is_meta for t in buffers)}
    finally:
        run.close()


def meta_built(rank: int, pp: int, disk: Path) -> dict:
    """A tied model built on the meta device, each rank seeded otherwise (each draws its stages' weights where
    they live): two 1F1B steps; the tied weight as this rank's stage holds it (the first stage's, or the last
    stage's copy; None on the others) before and after them, and the losses (every replica on the same
    batches)."""
    from tiertrain.api.pipeline import pipeline
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.plan.pipeline import PipelineLayout
    from tiertrain.runtime.state_io import export_state
    from tiertrain.train.optimizer import make_adamw

    torch.manual_seed(100 + rank)
    model = build({**TINY, "tie_embeddings": True}, device="meta")
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    run = pipeline(model, opt, PipelineLayout(pp=pp, schedule="1f1b", micro_batches=2),
                   Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)), plan="stream", page_size=64 << 10,
                   shard=False)  # replicated stages: each rank reads its tied weight whole

    def tied():
        held = [export_state(s.runtime)[0].get("tok_emb.weight") for s in run.stages if s.tied]
        return held[0] if held else None
    try:
        before, losses = tied(), []
        for b in batches(0)[:2]:  # every replica the same batches: they train alike where their weights are alike
            run.step(b[:, :-1], b[:, 1:])
            losses.append(run.micro_losses.tolist())
            run.optimizer.step()
            run.optimizer.zero_grad()
        others = all(p.is_meta for p in model.blocks[-1].parameters()) if run.mesh.pp_rank == 0 else None
        return {"before": before, "after": tied(), "losses": losses, "others_meta": others}
    finally:
        run.close()
