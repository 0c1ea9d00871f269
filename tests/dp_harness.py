"""Data-parallel runs for the tests: every configuration is trained in one set of spawned gloo ranks
(processes are started only because ranks are the point), against torch's
DistributedDataParallel with the same per-rank batches and the same fused AdamW."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import made

TINY4 = {"n_layer": 4, "n_head": 2, "d_model": 32, "d_ffn": 64, "vocab_size": 256, "max_seq_len": 64}
STEPS = 4


def rank_batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, (2, 17), generator=g) for _ in range(n)]


def rank_disk(disk: Path, rank: int) -> str:
    """This rank's disk-tier directory, in ``disk`` made here (``conftest.made``)."""
    return str(made(disk) / f"rank{rank}")


def _fresh():
    from tiertrain.train.optimizer import make_adamw
    from tiertrain.models import build

    torch.manual_seed(0)
    model = build(TINY4)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    return model, opt


def _probe(model, rank: int) -> float:
    """The trained weights as finely as fp32 shows them, for runs with accumulation: the float64 sum of the
    squares of one batch's logits. Two orders of summing the micro-batches' gradients differ by units in the
    last place, which AdamW's first steps mostly normalise away: a loss (one fp32 mean) can come out equal
    for both, this does not."""
    b = rank_batches(rank + 50, 1)[0]
    with torch.no_grad():
        return float(model(b[:, :-1]).double().pow(2).sum())


def _loop(model, opt, rank: int, accum: int, clip: float | None, clip_fn, no_sync=None,
          probe: bool = True, lr_decay: float | None = None) -> list[float]:
    """Each step's loss, and after them, with accumulation, the weights' ``_probe``. ``lr_decay``: each
    step's learning rate that times the last's, set after the step as a scheduler sets it (an update left
    for the next forward must still take its own step's)."""
    import contextlib

    from tiertrain.train.objective import lm_loss

    data, losses = rank_batches(rank, STEPS * accum), []
    for s in range(STEPS):
        total = 0.0
        for a in range(accum):
            b = data[s * accum + a]
            quiet = no_sync() if no_sync is not None and a < accum - 1 else contextlib.nullcontext()
            with quiet:
                loss = lm_loss(model, b[:, :-1], b[:, 1:]) / accum
                loss.backward()
            total += loss.item()
        if clip:
            clip_fn(clip)
        opt.step()
        if lr_decay is not None:
            for group in opt.param_groups:
                group["lr"] *= lr_decay
        opt.zero_grad()
        losses.append(total)
    return losses + ([_probe(model, rank)] if probe and accum > 1 else [])


def ddp_losses(rank: int, accum: int, clip: float | None, lr_decay: float | None = None) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, opt = _fresh()
    ddp = DDP(model)
    return _loop(ddp, opt, rank, accum, clip, lambda c: torch.nn.utils.clip_grad_norm_(ddp.parameters(), c),
                 ddp.no_sync, lr_decay=lr_decay)


def delayed_ddp_losses(rank: int) -> list[float]:
    """DDP whose replicas update a step late (``DelayedAdamW``): what lockfree at a fixed lag trains."""
    from delayed_update import DelayedAdamW
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, _ = _fresh()
    ddp = DDP(model)
    return _loop(ddp, DelayedAdamW(model), rank, 1, None, None)


def slow_publish_losses(rank: int, plan, disk: Path) -> tuple[list[float], int]:
    """``tiered_losses`` of lockfree at ``plan``'s fixed lag with rank 0's publishes held back 20 ms each, so
    the other rank runs ahead of them: its reads of a block must still wait for its own publish only."""
    import time

    from tiertrain.runtime.block_group import BlockGroup

    publish = BlockGroup.publish_and_take

    def slow(self):
        time.sleep(0.02)
        return publish(self)
    if rank == 0:
        BlockGroup.publish_and_take = slow
    try:
        return tiered_losses(rank, plan, "lockfree", 1, None, disk)
    finally:
        BlockGroup.publish_and_take = publish


def per_micro_losses(rank: int, accum: int) -> list[float]:
    """Plain PyTorch where each micro-batch's gradients are all-reduced and averaged as its backward
    ends and the averages summed over the micro-batches: what FSDP2 and ZeRO-3 do with accumulation by
    default, and what tiertrain's data parallel does (no rank keeps a whole block's gradients across
    micro-batches). DDP's ``no_sync`` sums the micro-batches first, another order of the same sum."""
    from tiertrain.train.objective import lm_loss

    model, opt = _fresh()
    world = dist.get_world_size()
    data, losses = rank_batches(rank, STEPS * accum), []
    for s in range(STEPS):
        total, summed = 0.0, {}
        for a in range(accum):
            b = data[s * accum + a]
            loss = lm_loss(model, b[:, :-1], b[:, 1:]) / accum
            loss.backward()
            total += loss.item()
            for p in model.parameters():
                grad, p.grad = p.grad, None
                dist.all_reduce(grad)
                grad.div_(world)
                summed[p] = summed[p].add_(grad) if p in summed else grad
        for p, grad in summed.items():
            p.grad = grad
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses + [_probe(model, rank)]


def tiered_losses(rank: int, plan, update: str, accum: int, clip: float | None, disk: Path,
                  reduce_dtype: str | None = None, reduce_every: str | None = None,
                  lr_decay: float | None = None) -> tuple[list[float], int]:
    import tiertrain
    from tiertrain.memory import Budgets, Tier

    model, opt = _fresh()
    budgets = Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank))
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, update=update, grad_accum=accum, max_grad_norm=clip,
                               page_size=64 << 10, reduce_dtype=reduce_dtype, reduce_every=reduce_every)
    try:  # over several ranks too the device pool maps what the plan counts (a count short of what the run
        # allocates fails the run: "the plan's count is short, a bug in tiertrain")
        assert tm.runtime.mem.pool(Tier.DEVICE).capacity == tm.runtime.plan.resolved.device < budgets.device
        assert type(tm.runtime.comm).__name__ == "PlacementChecked"  # every call below held to its side
        before = tm.runtime.comm.sent
        losses = _loop(tm, topt, rank, accum, clip, lambda c: torch.nn.utils.clip_grad_norm_(tm.parameters(), c),
                       probe=False, lr_decay=lr_decay)
        sent = tm.runtime.comm.sent - before
        if reduce_every == "step" and clip is None:  # the last step left every block's reduction in flight
            assert _left_in_flight(tm), "the step landed the reductions it could have left in flight"
        return losses + ([_probe(tm, rank)] if accum > 1 else []), sent
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def _left_in_flight(tm) -> bool:
    """Whether the last step left updates for the blocks' next use (sync) or landing on a worker (overlap)."""
    mode = tm.runtime.mode
    return bool(mode._later) or bool(getattr(mode, "_landing", ()))


def loaded_after_a_step(rank: int, plan) -> tuple[bool, bool]:
    """Reduced once a step (sync): after the steps each block's update waits for its next use; weights loaded
    then land it first. Whether updates were left so, and whether the next forward reads the loaded weights
    (an untrained model's) and not the last step's update written over them."""
    import tiertrain
    from tiertrain.memory import Budgets

    model, opt = _fresh()
    fresh, _ = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=plan, update="sync",
                               page_size=64 << 10, reduce_every="step")
    try:
        _loop(tm, topt, rank, 1, None, None, probe=False)
        left = _left_in_flight(tm)
        tm.load_state_dict(fresh.state_dict())
        return left, _probe(tm, rank) == _probe(fresh, rank)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def pool_peaks(rank: int, plan, disk: Path, accum: int = 2, reduce_every: str | None = None) -> dict[str, int]:
    """What this rank's pools held at most over a run with accumulation (the memory layer's own count,
    not the planner's): host bytes of gradients and of each state, disk bytes; and the largest part of a
    block a rank's grad chunk holds, and how many groups there are (the bounds' padding)."""
    import tiertrain
    from tiertrain.memory import Budgets, Kind, Tier

    model, opt = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)), plan=plan,
                               update="sync", grad_accum=accum, page_size=64 << 10, reduce_every=reduce_every)
    try:
        _loop(tm, topt, rank, accum, None, None)
        acc, groups = tm.runtime.mem.accounting, tm.runtime.groups
        peaks = {k.value: acc.peak(Tier.HOST, k) for k in (Kind.GRAD, Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)}
        return peaks | {"disk": acc.peak(Tier.DISK), "largest": max(g.state_numel for g in groups) * 4,
                        "groups": len(groups), "reducing": acc.peak(Tier.DEVICE, Kind.REDUCE),
                        "stage": max((g.layout.numel + (g.state_numel if g.shard else 0)) * 4 for g in groups),
                        "stages": sum(g.layout.numel * 4 for g in groups),
                        "part": max((g.state_numel if g.shard else 0) * 4 for g in groups),
                        "parts": sum((g.state_numel if g.shard else 0) * 4 for g in groups)}
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def disk_reads_by_thread(rank: int, plan, disk: Path) -> dict[str, int]:
    """Pages read from the disk tier over a few steps, by whether the step's own thread read them."""
    import threading

    import tiertrain.memory.disk as disk_tier

    counts = {"step thread": 0, "workers": 0}
    real = disk_tier.DiskPool.read_page

    def counted(self, page, out):
        counts["step thread" if threading.current_thread() is threading.main_thread() else "workers"] += 1
        return real(self, page, out)
    disk_tier.DiskPool.read_page = counted
    try:
        losses, _ = tiered_losses(rank, plan, "sync", 1, None, disk)
    finally:
        disk_tier.DiskPool.read_page = real
    return counts | {"steps": len(losses)}


def _rank_main(rank: int, world: int, store: str, jobs: list, results, errors) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # one thread a rank: the ranks share the machine's cores (at two each, 4 ranks on
    # 2 cores ran several times slower); one-process references held bit for bit run alike (conftest.at_one_thread)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for key, job in jobs:
            results[(key, rank)] = job(rank)
    except BaseException:
        errors[rank] = traceback.format_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, tmp: Path, jobs: list) -> dict:
    """``jobs``: (key, picklable callable of the rank); returns {(key, rank): result}."""
    # the manager is spawned, not forked: pytest's process may hold large mappings by now
    with mp.get_context("spawn").Manager() as manager:
        results, errors = manager.dict(), manager.dict()
        try:
            mp.spawn(_rank_main, args=(world, str(tmp / "store"), jobs, results, errors), nprocs=world, join=True)
        except Exception as exc:
            raise AssertionError("\n".join(dict(errors).values()) or str(exc)) from None
        return dict(results)


def sent_per_step(rank: int, plan, steps: int = 3, reduce_dtype: str = "fp32") -> dict:
    """Bytes this rank sent in each step, the slot fetches of each, and what the formulas need."""
    import tiertrain
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets

    model, opt = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=plan, page_size=64 << 10,
                               reduce_dtype=reduce_dtype)
    rt, data, out = tm.runtime, rank_batches(rank, steps), {"sent": [], "fetches": [], "within": [], "across": []}
    hybrid = rt.shards is not rt.comm  # hybrid sharding: the sharded blocks' groups count their own bytes
    try:
        for b in data:
            before = (rt.comm.sent, *((rt.shards.shard.sent, rt.shards.replicas.sent) if hybrid else ()))
            lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
            topt.step()
            topt.zero_grad()
            out["sent"].append(rt.comm.sent - before[0])
            if hybrid:
                out["within"].append(rt.shards.shard.sent - before[1])
                out["across"].append(rt.shards.replicas.sent - before[2])
            out["fetches"].append(rt.cache.pop_fetches())
        out["groups"] = [(g.layout.numel, len(g.params), g.shard is not None, g.plan.stream) for g in rt.groups]
        out["compute_bytes"] = rt.groups[0].compute.itemsize
        out["reduce_bytes"] = 2 if reduce_dtype == "bf16" else 4
        return out
    finally:
        rt.close()
        rt.mem.close()


def reduction_events(rank: int, plan) -> list[tuple[str, int]]:
    """One step's ("flush", block) and ("landed", block) events, in order: when each block's
    gradients were handed to the reduction and when its reduction was waited for; with hybrid sharding
    also ("across", block): when its shard's all-reduce across the groups was issued."""
    import tiertrain
    from tiertrain.memory import Budgets
    from tiertrain.parallel.hybrid import HybridCollectives
    from tiertrain.runtime.block_group import BlockGroup
    from tiertrain.runtime.group_state import Grads
    from tiertrain.train.objective import lm_loss

    events: list[tuple[str, int]] = []
    real = (BlockGroup.post_backward, BlockGroup.finish_reduction, BlockGroup._reduce_over_ranks,
            HybridCollectives.reduce_scatter)
    flush, finish, reduce, scatter = real
    making: list[int] = []  # the block whose reduction is being started

    def reduce_of(self, *args):
        making.append(self.index)
        try:
            return reduce(self, *args)
        finally:
            making.pop()

    def scattered(self, out, full, async_op=False):  # the gradients' all-reduce across, recorded when issued
        chain = scatter(self, out, full, async_op)
        if chain is not None:
            block, then = making[-1], chain._then
            chain._then = lambda: (events.append(("across", block)), then())[1]
        return chain
    BlockGroup.post_backward = lambda self: (events.append(("flush", self.index)), flush(self))[1]
    BlockGroup.finish_reduction = lambda self: (
        events.append(("landed", self.index)) if self.state[1] is Grads.REDUCING else None, finish(self))[1]
    BlockGroup._reduce_over_ranks, HybridCollectives.reduce_scatter = reduce_of, scattered
    model, opt = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=plan, page_size=64 << 10)
    try:
        b = rank_batches(rank, 1)[0]
        lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
        topt.step()
        return events
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
        (BlockGroup.post_backward, BlockGroup.finish_reduction, BlockGroup._reduce_over_ranks,
         HybridCollectives.reduce_scatter) = real


def gather_events(rank: int, plan, reduce_every: str | None = None) -> list[tuple[str, int]]:
    """Two steps' ("forward", block) and ("ahead", block) events: when each block's forward began and
    when a block's updated shards started gathering ahead of its own forward."""
    import tiertrain
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets
    from tiertrain.runtime.block_group import BlockGroup
    from tiertrain.runtime.group_state import Slot

    events: list[tuple[str, int]] = []
    begins, ahead = BlockGroup.pre_forward, BlockGroup.gather_ahead

    def gather_ahead(self):
        started = self.state[2] is not Slot.GATHERING
        ahead(self)
        if started and self.state[2] is Slot.GATHERING:
            events.append(("ahead", self.index))

    BlockGroup.pre_forward = lambda self: (events.append(("forward", self.index)), begins(self))[1]
    BlockGroup.gather_ahead = gather_ahead
    model, opt = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=plan, page_size=64 << 10,
                               reduce_every=reduce_every)
    try:
        for b in rank_batches(rank, 2):
            lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
            topt.step()
            topt.zero_grad()
        return events
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def agreed_auto_setup(rank: int, disk: Path) -> dict:
    """``plan="auto"`` with the page size and disk depth measured, each measurement stubbed so that
    rank 0's is quick and known and any other rank's fails the job: every rank must take rank 0's
    page size, depth and profile, and lay out the same plan."""
    import tiertrain
    from tiertrain.autoplan import auto_plan
    from tiertrain.autoplan.auto_plan import ProfileStep
    from tiertrain.measure import disk_depth, page_size
    from tiertrain.train.objective import lm_loss
    from tiertrain.memory import Budgets

    def only_rank0(value):
        def measure(*args, **kwargs):
            if rank != 0:
                raise AssertionError(f"rank {rank} measured what rank 0 measures for all")
            return value(*args, **kwargs) if callable(value) else value
        return measure

    saved = page_size.measured_page_size, disk_depth.measured_depth, auto_plan._measured, disk_depth.DEPTH_WORTH
    disk_depth.DEPTH_WORTH = 0  # this model's states are small, but the ranks' agreement is what is tested
    page_size.measured_page_size = only_rank0(128 << 10)
    disk_depth.measured_depth = only_rank0(disk_depth.DiskDepth(3, 1, {2: 1.0, 4: 1.0, 8: 1.0}, 1.0, 1.0))
    auto_plan._measured = only_rank0(saved[2])
    model, opt = _fresh()
    step = ProfileStep(model, lm_loss, 256, 2, 16, contextlib.nullcontext, torch.device("cpu"))
    try:
        tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)),
                                   plan="auto", update="sync", profile_step=step)
        try:
            losses = _loop(tm, topt, rank, 1, None, None)
            io = tm.runtime.mem.mover._io
            return {"plan": tm.runtime.plan.to_json(), "profile": tm.auto_plan.profile.to_json(),
                    "page": tm.runtime.mem.page_size, "io": (len(io._threads), io._write_share), "losses": losses}
        finally:
            tm.runtime.close()
            tm.runtime.mem.close()
    finally:
        page_size.measured_page_size, disk_depth.measured_depth, auto_plan._measured, disk_depth.DEPTH_WORTH = saved


def agreed_budgets(rank: int) -> list[tuple[int, int]]:
    """The budgets taken from the machine where rank 0 sees 8 GiB available and rank 1 4 GiB: all
    taken, then with a host budget of 1 GiB given."""
    from tiertrain.api import machine_budgets as budgets

    saved = budgets.host_available
    budgets.host_available = lambda: (8 << 30) if rank == 0 else (4 << 30)
    try:
        got = [budgets.machine_budgets(torch.device("cpu"), given_host=host).budgets for host in (None, 1 << 30)]
        return [(b.device, b.host) for b in got]
    finally:
        budgets.host_available = saved


def failure_on_rank0(rank: int) -> str:
    """What each rank raises when rank 0's measurement fails."""
    from tiertrain.errors import ConfigError
    from tiertrain.parallel.agree import from_rank0

    def fails() -> int:
        raise ConfigError("the disk under /nowhere cannot be read")

    try:
        from_rank0("the page size", fails, str, int)
    except ConfigError as exc:
        return str(exc)
    return "nothing raised"


def recheck_on_rank0(rank: int) -> dict:
    """``Trainer._recheck`` over two ranks, with ``auto_plan.recheck`` stubbed to take a second: who
    ran it, when it ended, and when each rank's ``_recheck`` returned and with what."""
    import time
    from types import SimpleNamespace

    from tiertrain.autoplan import auto_plan
    from tiertrain.train.loop import Trainer

    ran, saved = [], auto_plan.recheck

    def slow_recheck(auto, measured, peaks, plan, wait, load=None):
        time.sleep(1.0)
        ran.append(time.time())
        return "corrected", "recheck: 40% off, corrected"

    auto_plan.recheck = slow_recheck
    try:
        trainer = SimpleNamespace(auto="as planned", model=SimpleNamespace(runtime=SimpleNamespace(
            plan=None, wait_updates=lambda: None)))
        got = Trainer._recheck(trainer, [1.0, 1.1], {"device": 1})
    finally:
        auto_plan.recheck = saved
    return {"ran": ran, "returned": time.time(), "got": list(got)}


def mismatched_setup(rank: int, what: str) -> str:
    """What setup raises on this rank where rank 1 was started with another accumulation or plan."""
    import tiertrain
    from tiertrain.errors import ConfigError
    from tiertrain.memory import Budgets
    from tiertrain.plan import builtin_plan

    model, opt = _fresh()
    plan = builtin_plan("resident", TINY4["n_layer"])
    if what == "plan" and rank == 1:  # one block recomputed: the plans differ in their blocks alone
        plan = dataclasses.replace(plan, blocks=(dataclasses.replace(plan.blocks[0], recompute=True), *plan.blocks[1:]))
    accum = 1 + rank if what == "accumulation" else 1
    try:
        tm, _ = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan=plan, grad_accum=accum,
                                page_size=64 << 10)
    except ConfigError as exc:
        return str(exc)
    tm.runtime.close()
    tm.runtime.mem.close()
    return "set up"


def mismatched_collective(rank: int) -> str:
    """What an all-reduce of 10 floats on rank 0 and 12 on rank 1 raises on each, under torch's
    collective checks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``; without them gloo aborts the process)."""
    from tiertrain.parallel.distributed import ProcessGroupCollectives

    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        comm = ProcessGroupCollectives(dist.new_group(backend="gloo"))
        try:
            comm.all_reduce(torch.zeros(10 + 2 * rank))
        except Exception as exc:  # noqa: BLE001 - what it is, is the result
            return f"{type(exc).__name__}: {exc}"
        finally:
            comm.close()
        return "nothing raised"
    finally:
        dist.set_debug_level(before)
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]


WIDE = {"n_layer": 4, "n_head": 2, "d_model": 64, "d_ffn": 256, "vocab_size": 256, "max_seq_len": 64}
GLOBAL_ROWS = 4  # each step's batch, split over the ranks: 2 rows each at dp = 2, 1 at dp = 4


def _global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (GLOBAL_ROWS, 17), generator=torch.Generator().manual_seed(1000 + step))


def _wide_run(plan, rank: int, disk: Path):
    import tiertrain
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.train.optimizer import make_adamw

    torch.manual_seed(0)
    model = build(WIDE)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    return tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(disk, rank)), plan=plan,
                           page_size=64 << 10)


def _global_losses(tm, topt, rank: int, steps: range) -> list[float]:
    """Each step's loss over the whole batch (the ranks' means averaged), this rank training on its rows."""
    from tiertrain.train.objective import lm_loss

    world, out = dist.get_world_size() if dist.is_initialized() else 1, []
    for s in steps:
        rows = _global_batch(s).chunk(world)[rank]
        loss = lm_loss(tm, rows[:, :-1], rows[:, 1:])
        loss.backward()
        topt.step()
        topt.zero_grad()
        mean = loss.detach().reshape(1).clone()
        if world > 1:
            dist.all_reduce(mean)
        out.append(mean.item() / world)
    return out


def one_process_checkpoint(tmp: Path) -> tuple[str, list[float]]:
    """In this process (one rank): steps 1-2 on the whole batches, a plain checkpoint, steps 3-5."""
    from tiertrain.checkpoint.run import TrainerState, save_checkpoint
    from tiertrain.checkpoint.train_state import TieredState

    tm, topt = _wide_run(builtin_plan_for_harness(), 0, tmp / "disk-one")
    try:
        _global_losses(tm, topt, 0, range(1, 3))
        ckpt = save_checkpoint(tmp / "one", TieredState(tm), TrainerState(2, 2, {}, {}), 2)
        return str(ckpt), _global_losses(tm, topt, 0, range(3, 6))
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def saved_then_uninterrupted(rank: int, plan, tmp: Path) -> tuple[str, list[float]]:
    """Steps 1-2, a sharded checkpoint, then steps 3-5 uninterrupted: (the checkpoint, losses of 3-5)."""
    from tiertrain.checkpoint.run import TrainerState, save_checkpoint
    from tiertrain.checkpoint.train_state import TieredState

    tm, topt = _wide_run(plan, rank, tmp / "disk-saved")
    try:
        _global_losses(tm, topt, rank, range(1, 3))
        ckpt = save_checkpoint(tmp / "saved", TieredState(tm), TrainerState(2, 2, {}, {}, dist.get_world_size()), 2)
        return str(ckpt), _global_losses(tm, topt, rank, range(3, 6))
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def resumed_by_parts(rank: int, plan, ckpt: str, tmp: Path) -> dict:
    """The checkpoint loaded at this world size and steps 3-5 trained: their losses, the bytes this rank
    read from the rank files (``checkpoint.pieces.READ``), its share of the states and the bound on
    what reading by pieces adds (two pieces per range read, and the headers)."""
    from tiertrain.checkpoint.pieces import READ, piece_size
    from tiertrain.checkpoint.run import load_checkpoint
    from tiertrain.checkpoint.train_state import TieredState

    tm, topt = _wide_run(plan, rank, tmp / "disk-resumed")
    try:
        before = READ.bytes
        load_checkpoint(Path(ckpt), TieredState(tm))
        read = READ.bytes - before
        groups = tm.runtime.groups
        files = sorted(Path(ckpt).glob("shard-*.safetensors"))
        piece = max((piece_size(f.stat().st_size) for f in files), default=0)
        ranges = 4 * len(groups) * 2  # per group: master, two moments and the steps, each from at most two files
        return {"losses": _global_losses(tm, topt, rank, range(3, 6)), "read": read,
                "share": sum(3 * g.state_numel * 4 for g in groups), "slack": 2 * piece * ranges + 64 * 1024 * len(files),
                "total": sum(f.stat().st_size for f in files)}
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def unshared_save(rank: int, tmp: Path) -> str:
    """Each rank saves into an output directory of its own, as ranks on nodes without a shared filesystem
    would: what each raises."""
    from tiertrain.checkpoint.run import TrainerState, save_checkpoint
    from tiertrain.checkpoint.train_state import TieredState
    from tiertrain.errors import OutputError

    tm, _ = _wide_run(builtin_plan_for_harness(), rank, tmp / "disk-unshared")
    try:
        save_checkpoint(tmp / f"unshared-{rank}", TieredState(tm), TrainerState(1, 1, {}, {}, 2), 2)
    except OutputError as exc:
        return str(exc)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    return "saved"


def builtin_plan_for_harness():
    from tiertrain.plan import builtin_plan

    return builtin_plan("stream", WIDE["n_layer"])


def killed_in_second_save(rank: int, world: int, store: str, tmp: str, errors) -> None:
    """A rank process: step 1, a checkpoint, step 2, and a second checkpoint during which rank 1 is
    SIGKILLed halfway through writing its rank file; rank 0's error is kept in ``errors``."""
    import signal

    from tiertrain.checkpoint import run as ckpt_run
    from tiertrain.checkpoint.run import TrainerState, save_checkpoint
    from tiertrain.checkpoint.train_state import TieredState

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tm, topt = _wide_run(builtin_plan_for_harness(), rank, Path(tmp) / "disk-killed")
    try:
        _global_losses(tm, topt, rank, range(1, 2))
        save_checkpoint(Path(tmp) / "killed", TieredState(tm), TrainerState(1, 1, {}, {}, world), 2)
        _global_losses(tm, topt, rank, range(2, 3))
        if rank == 1:
            def dies(at: Path, rt, steps) -> int:
                from tiertrain.checkpoint.sharded import shard_file

                (at / shard_file(1, world)).write_bytes(b"\0" * 4096)  # half a file, then gone
                os.kill(os.getpid(), signal.SIGKILL)
                return 0
            ckpt_run.write_rank_file = dies
        save_checkpoint(Path(tmp) / "killed", TieredState(tm), TrainerState(2, 2, {}, {}, world), 2)
    except BaseException as exc:  # noqa: BLE001 - rank 0's error is what the test reads
        errors[rank] = f"{type(exc).__name__}: {exc}"
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def run_ranks_one_dies(world: int, tmp: Path, target=None) -> tuple[dict, list[int | None]]:
    """``target`` (``killed_in_second_save`` by default: a rank process that loses one) on ``world`` ranks:
    each rank's error, and each process's exit code."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        errors = manager.dict()
        procs = [ctx.Process(target=target or killed_in_second_save,
                             args=(r, world, str(tmp / "store-killed"), str(tmp), errors))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=180)
            if p.is_alive():
                p.kill()
                p.join()
        return dict(errors), [p.exitcode for p in procs]


def backward_twice(rank: int) -> str:
    """Gradients reduced once a step, accumulation 1: a second backward before ``step`` (a loop whose
    ``grad_accum`` is short of its micro-batches) while the first's reductions are still in flight."""
    import tiertrain
    from tiertrain.memory import Budgets
    from tiertrain.train.objective import lm_loss

    model, opt = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=64 << 10,
                               reduce_every="step")
    b = rank_batches(rank, 1)[0]
    try:
        lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
        try:
            lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
        except RuntimeError as exc:
            return str(exc)
        return "no error"
    finally:
        topt.zero_grad()
        tm.runtime.close()
        tm.runtime.mem.close()


def raised_then_trained(rank: int) -> list[float]:
    """A backward stopped by an error part way (a hook raising, as an out-of-memory would), ``zero_grad``,
    then the usual steps: their losses (DDP's, bit for bit, if the stopped backward left nothing behind)."""
    import tiertrain
    from tiertrain.memory import Budgets
    from tiertrain.train.objective import lm_loss

    model, opt = _fresh()
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20), plan="stream", page_size=64 << 10)
    try:
        b = rank_batches(rank + 7, 1)[0]
        hook = tm.blocks[1].register_full_backward_pre_hook(lambda m, g: (_ for _ in ()).throw(MemoryError("hook")))
        try:
            lm_loss(tm, b[:, :-1], b[:, 1:]).backward()
        except MemoryError:
            pass
        hook.remove()
        topt.zero_grad()
        return _loop(tm, topt, rank, 1, None, None)
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
