"""The collectives block groups call: the identity in a world of one, and over torch.distributed
(gloo) the sums and gathers each promises (issue 17: one interface, two implementations)."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tiertrain.errors import ConfigError
from tiertrain.parallel import LocalCollectives, collectives_for
from tiertrain.plan import ParallelLayout, Plan, builtin_plan, data_parallel


def test_a_world_of_one_moves_tensors_whole_and_changes_nothing_in_place():
    comm = collectives_for(1)
    assert isinstance(comm, LocalCollectives) and (comm.rank, comm.world_size) == (0, 1)
    t = torch.arange(6.0)
    out = torch.zeros(6)
    comm.all_gather(out, t)
    assert torch.equal(out, t)
    comm.reduce_scatter(t, t)       # in place: the chunk is its own shard
    comm.all_reduce(t)
    assert torch.equal(t, torch.arange(6.0))
    with pytest.raises(ValueError, match="whole"):
        comm.reduce_scatter(torch.zeros(3), t)


def test_the_plan_carries_its_parallel_layout_and_a_one_process_plan_is_laid_out_over_the_ranks():
    plan = builtin_plan("stream", 2)
    assert plan.parallel == ParallelLayout(dp=1) and json.loads(plan.to_json())["parallel"] == {"dp": 1}
    assert Plan.from_json(plan.to_json()) == plan
    laid = data_parallel(plan, 4)
    assert laid.parallel.dp == 4 and all(b.shard for b in (*laid.blocks, laid.rest))
    assert Plan.from_json(laid.to_json()) == laid and data_parallel(laid, 4) is laid
    assert not any(b.shard for b in data_parallel(plan, 4, shard=False).blocks)


def _ranks(rank: int, world: int, store: str, results) -> None:
    import torch.distributed as dist

    from tiertrain.parallel.distributed import ProcessGroupCollectives

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        comm = ProcessGroupCollectives()
        shard = torch.full((3,), float(rank + 1))
        gathered = torch.zeros(3 * world)
        comm.all_gather(gathered, shard)
        full = torch.arange(2.0 * world) + rank          # each rank's whole chunk
        mine = torch.zeros(2)
        comm.reduce_scatter(mine, full)
        total = torch.tensor([float(rank)])
        comm.all_reduce(total)
        sent = torch.full((world,), float(rank))        # slice r goes to rank r
        got = torch.zeros(world)
        comm.all_to_all(got, sent)
        results[rank] = (gathered.tolist(), mine.tolist(), total.item(), got.tolist())
    finally:
        dist.destroy_process_group()


def test_collectives_over_torch_distributed_sum_and_gather_as_promised(tmp_path):
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ranks, args=(world, str(tmp_path / "store"), results), nprocs=world, join=True)
        got = dict(results)
    for rank in range(world):
        gathered, mine, total, a2a = got[rank]
        assert gathered == [1.0] * 3 + [2.0] * 3
        summed = [sum(i + r for r in range(world)) for i in range(2 * world)]  # sum over ranks of arange + rank
        assert mine == summed[2 * rank : 2 * rank + 2]
        assert total == sum(range(world)) and a2a == [float(r) for r in range(world)]


def test_a_failed_collective_is_a_lost_rank_only_where_a_heartbeat_stopped(monkeypatch):
    """``parallel.health.failure``: a rank whose heartbeat stopped is named as lost; where every rank
    beats on, the collective's own error is reported, in the backend's words (the source path it starts
    with dropped), with the switch that makes torch compare collectives across ranks."""
    from tiertrain.parallel.health import CollectiveFailed, RankLost, failure

    class Beats:
        rank, world = 0, 4

        def __init__(self, lost):
            self._lost = lost

        def lost(self):
            return self._lost

    exc = RuntimeError("[/pytorch/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5555")
    lost = failure(Beats([2, 3]), exc, "all_gather")
    assert isinstance(lost, RankLost) and str(lost).startswith("ranks 2, 3 of 4 stopped (its process is gone")
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    own = failure(Beats([]), RuntimeError("Timed out waiting 60000ms for recv operation"), "reduce_scatter")
    assert isinstance(own, CollectiveFailed) and own.exit_code == 1
    assert str(own).startswith("reduce_scatter failed on rank 0 while every rank is alive: Timed out waiting 60000ms")
    assert "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL" in str(own)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert "TORCH_DISTRIBUTED_DEBUG" not in str(failure(Beats([]), exc, "all_gather"))


def test_the_placement_check_holds_each_side_to_its_memory_on_a_cpu_machine_too():
    """Every tier is host memory here, yet the memory system knows which pool a tensor lies in: the
    device group takes views of the device pool (an all-to-all's rows, activations, anything but a host
    pool's), the CPU group anything but the device pool. Each refusal names the call and the tier."""
    from tiertrain.memory import Budgets, Kind, MemorySystem, Tier
    from tiertrain.parallel.placement import MisplacedTensor, PlacementChecked, checked

    with MemorySystem(Budgets(1 << 20, 1 << 20, 0), page_size=4096) as mem:
        on_device = mem.allocate("d", 4096, Tier.DEVICE, Kind.GRAD, contiguous=True).typed(torch.float32)
        on_host = mem.allocate("h", 4096, Tier.HOST, Kind.GRAD, contiguous=True).typed(torch.float32)
        plain = torch.zeros(8)
        assert [mem.tier_of(t) for t in (on_device[3:], on_host, plain)] == [Tier.DEVICE, Tier.HOST, None]
        comm = PlacementChecked(LocalCollectives(), mem.tier_of)
        comm.all_reduce(on_device)
        comm.reduce_scatter(on_device, on_device)
        comm.host.all_reduce(plain)
        comm.host.broadcast(on_host)
        comm.all_to_all(plain, plain, [8], [8])  # rows: activations beside the pools
        for call in (lambda: comm.all_reduce(on_host), lambda: comm.broadcast(plain),
                     lambda: comm.all_gather(on_device, on_host[:1024]), lambda: comm.host.all_reduce(on_device),
                     lambda: comm.all_to_all(on_host[:8], plain, [8], [8])):
            with pytest.raises(MisplacedTensor, match="internal: (all_reduce|broadcast|all_gather|all_to_all) on the "
                                                      "(device|host) group was given a tensor of"):
                call()
        with pytest.raises(MisplacedTensor, match="host tier; the device group takes device-tier memory only"):
            comm.all_reduce(on_host)
        assert checked(comm, mem.tier_of) is comm and comm.host.host is comm.host  # wrapped once
        assert os.environ["TIERTRAIN_CHECK_COLLECTIVES"] == "1"  # on for the suite and the ranks it starts
