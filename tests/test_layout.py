import random

import pytest

from tiertrain.memory import layout as L
from tiertrain.measure import page_size as P
from tiertrain.memory.pool import check_page_size
from tiertrain.plan.budgets import Budgets
from tiertrain.errors import ConfigError


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 8])
def test_layout_is_parameter_order_and_splits_evenly_into_aligned_shards(shards):
    model = __import__("tiertrain.models", fromlist=["build"]).build("tiny")
    block = model.blocks[0]
    tensors = [(n, tuple(p.shape)) for n, p in block.named_parameters()]
    lay = L.ChunkLayout.build(tensors, shard_count=shards)
    assert [s.name for s in lay.slots] == [n for n, _ in tensors]
    # in order, not overlapping, each start aligned like torch's allocator, gaps below one alignment unit
    assert all(a.offset + a.numel <= b.offset < a.offset + a.numel + L.TENSOR_ALIGN
               for a, b in zip(lay.slots, lay.slots[1:]))
    assert all(s.offset % L.TENSOR_ALIGN == 0 for s in lay.slots)
    assert lay.used == sum(p.numel() for p in block.parameters())
    assert lay.numel % (shards * L.DEFAULT_ALIGN) == 0 and lay.numel >= lay.slots[-1].offset + lay.slots[-1].numel
    ranges = [lay.shard_range(r) for r in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == lay.numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len({e - s for s, e in ranges}) == 1


def test_pack_never_splits_a_tensor_and_keeps_order():
    numels = [5, 3, 8, 1, 1, 7]
    chunks = L.pack(numels, 8)
    assert chunks == [[0, 1], [2], [3, 4], [5]]
    assert [i for c in chunks for i in c] == list(range(len(numels)))


def brute_force(groups, low, high, step, shards, align):
    best = None
    for c in range(low, high + 1, step):
        cap = -(-c // (shards * align)) * (shards * align)
        if cap < max(n for g in groups for n in g):
            continue
        # waste by explicit simulation of packing, independent of L.pack
        w = 0
        for g in groups:
            used, opened = 0, False
            for n in g:
                if not opened or used + n > cap:
                    w += cap - used if opened else 0
                    used, opened = 0, True
                used += n
            w += cap - used
        if best is None or (w, cap) < (best[1], best[0]):
            best = (cap, w)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_chunk_size_search_equals_brute_force(seed):
    rng = random.Random(seed)
    groups = [[rng.randint(1, 500) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 5))]
    shards, align = rng.choice([1, 2, 4]), rng.choice([1, 8])
    got = L.search_chunk_size(groups, 100, 3000, 37, shards, align)
    assert got == brute_force(groups, 100, 3000, 37, shards, align)


def test_chunk_size_search_refuses_a_range_too_small():
    with pytest.raises(ValueError, match="holds the largest tensor"):
        L.search_chunk_size([[1000]], 10, 100, 10)


def test_page_size_is_the_smallest_reaching_95_percent_of_the_plateau():
    curve = {64: 1.0, 128: 5.0, 256: 9.4, 512: 9.8, 1024: 10.0, 2048: 9.9}
    assert P.pick(curve) == 512
    assert P.pick(curve, fraction=0.9) == 256


def test_measured_page_size_is_cached_per_machine_and_link(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_curve(directory, **kw):
        calls.append(directory)
        return {4096: 1.0, 8192: 2.0, 16384: 2.05}

    monkeypatch.setattr(P, "disk_curve", fake_curve)
    import torch

    assert P.measured_page_size(str(tmp_path), torch.device("cpu")) == 8192
    assert P.measured_page_size(str(tmp_path), torch.device("cpu")) == 8192
    assert len(calls) == 1


def test_a_disk_page_is_also_no_smaller_than_the_cpu_cost_per_byte_allows(tmp_path, monkeypatch):
    """Bandwidth plateaus at 8 KiB, but each byte costs the cores much more below 32 KiB: 32 KiB."""
    monkeypatch.setenv("TIERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    assert P.pick_cheap({4096: 4.0, 8192: 3.0, 16384: 2.0, 32768: 1.2, 65536: 1.0}) == 32768

    def fake_curve(directory, cpu=None, **kw):
        cpu.update({4096: 4.0, 8192: 3.0, 16384: 2.0, 32768: 1.2, 65536: 1.0})
        return {4096: 1.0, 8192: 2.0, 16384: 2.05, 32768: 2.0, 65536: 2.0}

    monkeypatch.setattr(P, "disk_curve", fake_curve)
    import torch

    assert P.measured_page_size(str(tmp_path), torch.device("cpu")) == 32768


def test_real_disk_curve_rises_with_page_size(tmp_path):
    cpu = {}
    curve = P.disk_curve(tmp_path, total=16 * P.MiB, workers=2, cpu=cpu)
    assert set(curve) == set(P.CANDIDATES) == set(cpu) and all(v > 0 for v in curve.values())
    assert list(tmp_path.iterdir()) == []


def test_budgets_parse_sizes_and_disk_spec():
    b = Budgets.parse("512MiB", "8GiB", "/mnt/nvme:1TiB")
    assert (b.device, b.host, b.disk, b.disk_dir) == (512 << 20, 8 << 30, 1 << 40, "/mnt/nvme")
    assert Budgets.parse("1GB", "2GB").disk == 0
    with pytest.raises(ConfigError, match="cannot read size '8 gigs'"):
        Budgets.parse("8 gigs", "1GiB")
    with pytest.raises(ConfigError, match="page size 1000"):
        check_page_size(1000)


def test_bench_memory_prints_tier_figures_beside_the_raw_disk(tmp_path):
    import json

    from conftest import run_cli

    out = tmp_path / "bench.json"
    r = run_cli("bench", "memory", "--disk", str(tmp_path / "d"), "--size", "8MiB", "--page-sizes", "256KiB",
                "--chunk", "1MiB", "--repeats", "1", "--io-workers", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "of the raw disk (target >= 0.85)" in r.stdout and "machine:" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert any(row["page"] == 256 * 1024 for row in rows)
    assert all(row["tier"]["write"] > 0 and row["raw_qd"]["read"] > 0 for row in rows)
    assert list((tmp_path / "d").iterdir()) == []  # the benchmark leaves nothing behind
