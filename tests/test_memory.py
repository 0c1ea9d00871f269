import itertools
import os
import random
import stat

import pytest
import torch

from tiertrain.errors import BudgetError, ConfigError, DiskError
from tiertrain.memory import Budgets, Kind, MemorySystem, Tier
from tiertrain.memory.pages import PageTable

PS = 64 * 1024  # small pages keep the tests fast; the layout rules do not depend on the size
SIZES = [0, 1, PS - 1, PS, PS + 1, 7 * PS + 123]
TIERS = [Tier.DEVICE, Tier.HOST, Tier.DISK]


@pytest.fixture
def mem(tmp_path):
    with MemorySystem(Budgets(device=64 * PS, host=64 * PS, disk=64 * PS, disk_dir=str(tmp_path / "disk")),
                      page_size=PS, io_workers=4) as m:
        yield m


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src,dst", [p for p in itertools.product(TIERS, TIERS) if p[0] != p[1]])
def test_bitwise_round_trip_through_every_pair_of_tiers(mem, n, src, dst):
    # A neighbour allocated first leaves a partly filled page, so large chunks start mid-page.
    neighbour = mem.from_tensor("neighbour", random_bytes(PS + PS // 3, 1), src)
    data = random_bytes(n, 2)
    chunk = mem.from_tensor("c", data, src)
    mem.move(chunk, dst).wait()
    assert chunk.tier is dst
    assert torch.equal(mem.to_tensor(chunk), data)
    mem.move(chunk, src).wait()
    assert torch.equal(mem.to_tensor(chunk), data)
    assert torch.equal(mem.to_tensor(neighbour), random_bytes(PS + PS // 3, 1))


def test_many_moves_in_flight_at_once(mem):
    rng = random.Random(0)
    data = [random_bytes(rng.randint(0, 3 * PS), i) for i in range(24)]
    chunks = [mem.from_tensor(f"c{i}", d, Tier.HOST) for i, d in enumerate(data)]
    for round_ in range(4):
        targets = [rng.choice(TIERS) for _ in chunks]
        handles = [mem.move(c, t) for c, t in zip(chunks, targets)]  # all issued before any wait
        for h in handles:
            h.wait()
        assert [c.tier for c in chunks] == targets
    for c, d in zip(chunks, data):
        assert torch.equal(mem.to_tensor(c), d)


def test_a_page_holds_parts_of_at_most_two_chunks():
    table = PageTable(n_pages=200, page_size=1000, share_pages=True)
    rng = random.Random(1)
    owners_of = {}
    for i in range(60):
        for e in table.allocate(rng.choice([1, 999, 1000, 1001, 2500, 4321])):
            owners_of.setdefault(e.page, set()).add(i)
    assert max(len(o) for o in owners_of.values()) == 2
    # A chunk smaller than a page gets a page of its own.
    small = table.allocate(10)
    assert len(small) == 1 and small[0].offset == 0 and table.owners(small[0].page) == 1


def test_budget_refusal_names_tier_bytes_and_budget_and_changes_nothing(mem):
    with pytest.raises(BudgetError, match=r"device tier cannot hold 4\.06 MiB more: budget 4\.00 MiB"):
        mem.allocate("big", 64 * PS + 1, Tier.DEVICE)
    data = random_bytes(40 * PS)
    resident = mem.from_tensor("a", data, Tier.DEVICE)
    moving = mem.from_tensor("b", data, Tier.HOST)
    before = mem.stats()
    with pytest.raises(BudgetError, match="device tier"):
        mem.move(moving, Tier.DEVICE)
    assert moving.tier is Tier.HOST and torch.equal(mem.to_tensor(moving), data)
    assert mem.stats() == before
    assert mem.pool(Tier.DEVICE).used_bytes <= mem.pool(Tier.DEVICE).budget
    mem.release(resident)
    mem.move(moving, Tier.DEVICE).wait()  # fits once the other chunk is gone


def test_a_move_from_a_chunk_holding_the_same_bytes_reads_nothing_from_disk(mem):
    """``move_from``: a disk chunk brought to the host from a memory chunk known to hold its bytes (a
    device slot filled from it), asynchronously; the disk reads nothing and gives its pages back, and a
    budget refusal changes nothing, as ``move``'s."""
    data = random_bytes(5 * PS + 7)
    chunk = mem.from_tensor("master", data, Tier.DISK)
    slot = mem.allocate("slot", 6 * PS, Tier.DEVICE)  # larger than the chunk, as a slot sized to the largest block
    slot.typed(torch.uint8)[: data.numel()].copy_(data)
    read, disk_live = mem.disk_traffic()["read"], mem.accounting.live(Tier.DISK)
    with pytest.raises(ValueError, match="at least as large"):
        mem.move_from(chunk, Tier.HOST, mem.allocate("small", 5 * PS, Tier.DEVICE))
    hog = mem.allocate("hog", 60 * PS, Tier.HOST)
    before = mem.stats()
    with pytest.raises(BudgetError, match="host tier"):
        mem.move_from(chunk, Tier.HOST, slot)
    assert chunk.tier is Tier.DISK and mem.stats() == before
    mem.release(hog)
    mem.move_from(chunk, Tier.HOST, slot, contiguous=True).wait()
    assert chunk.tier is Tier.HOST and torch.equal(mem.to_tensor(chunk), data)
    assert mem.disk_traffic()["read"] == read and mem.accounting.live(Tier.DISK) == disk_live - data.numel()
    mem.move(chunk, Tier.DISK).wait()  # home again, written with checksums of its bytes, read back verified
    assert torch.equal(mem.to_tensor(chunk), data)


def test_a_copy_from_a_chunk_still_moving_waits_for_the_move_and_reads_it_where_it_lands(mem, monkeypatch):
    """A master copied out of its slot is still on its way to the host while a refill of another slot
    may copy from it: that copy must not read the disk pages the landing move gives back (each disk
    read is slowed here, so a copy that did not wait would find them freed), but wait for the move
    and copy the bytes where they landed."""
    import time

    from tiertrain.memory.disk import DiskPool
    from tiertrain.memory.movement import Mover

    data = random_bytes(5 * PS + 7)
    chunk = mem.from_tensor("master", data, Tier.DISK)
    slot = mem.allocate("slot", 6 * PS, Tier.DEVICE)
    slot.typed(torch.uint8)[: data.numel()].copy_(data)
    read_page, scatter = DiskPool.read_page, Mover._scatter
    monkeypatch.setattr(DiskPool, "read_page", lambda self, page, out: (time.sleep(0.3), read_page(self, page, out)))
    monkeypatch.setattr(Mover, "_scatter", staticmethod(  # the copy out of the slot lands 0.1 s from now
        lambda dst, ds, src, ss, n: (time.sleep(0.1 if src is slot else 0), scatter(dst, ds, src, ss, n))))
    moving = mem.move_from(chunk, Tier.HOST, slot, contiguous=True)
    assert not moving.done()
    refill = mem.allocate("refill", 6 * PS, Tier.DEVICE)
    mem.mover.copy(chunk, refill).wait()
    assert moving.done() and chunk.tier is Tier.HOST
    assert torch.equal(refill.typed(torch.uint8)[: data.numel()], data)


def test_accounting_tracks_live_and_peak_per_tier_and_kind(mem):
    a = mem.allocate("m", 3 * PS, Tier.HOST, Kind.MASTER)
    b = mem.allocate("g", PS, Tier.HOST, Kind.GRAD)
    mem.move(a, Tier.DISK).wait()
    assert mem.accounting.live(Tier.HOST) == PS and mem.accounting.live(Tier.DISK, Kind.MASTER) == 3 * PS
    assert mem.accounting.peak(Tier.HOST) == 4 * PS and mem.accounting.peak(Tier.HOST, Kind.MASTER) == 3 * PS
    mem.release(b)
    assert mem.stats()["host"]["live"] == 0 and mem.stats()["host"]["peak_by_kind"]["grad"] == PS


def test_merge_makes_a_scattered_chunk_contiguous_within_the_tier(mem):
    pins = [mem.allocate(f"p{i}", PS, Tier.HOST) for i in range(64)]
    for p in pins[1:6:2]:
        mem.release(p)  # the only free pages: 1, 3, 5
    data = random_bytes(3 * PS)
    chunk = mem.from_tensor("scattered", data, Tier.HOST)
    assert [e.page for e in chunk.extents] == [1, 3, 5] and not chunk.is_contiguous()
    with pytest.raises(BudgetError, match="host tier"):
        chunk.merge()  # no free run of 3 pages: merging must not go past the budget
    for p in pins[40:43]:
        mem.release(p)
    flat = chunk.merge()
    assert [e.page for e in chunk.extents] == [40, 41, 42] and chunk.is_contiguous() and torch.equal(flat, data)
    assert mem.pool(Tier.HOST).used_bytes == 64 * PS - 3 * PS  # the scattered pages went back
    assert chunk.merge().data_ptr() == flat.data_ptr()  # contiguous: a view, no copy
    floats = chunk.typed(torch.float32)
    assert floats.numel() == 3 * PS // 4 and torch.equal(floats.view(torch.uint8), data)


def _disk_page_offset(chunk) -> int:
    return chunk.extents[0].page * chunk.pool.page_size


def test_a_flipped_byte_in_a_page_file_is_detected(mem):
    data = random_bytes(2 * PS)
    chunk = mem.from_tensor("c", data, Tier.DISK)
    pool = mem.pool(Tier.DISK)
    offset = _disk_page_offset(chunk) + 1234
    with open(pool.file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    host_before = mem.accounting.live(Tier.HOST)
    with pytest.raises(DiskError, match=rf"checksum mismatch in {pool.file} at offset {_disk_page_offset(chunk)}"):
        mem.move(chunk, Tier.HOST).wait()
    assert chunk.tier is Tier.DISK and mem.accounting.live(Tier.HOST) == host_before


def test_reading_a_disk_chunk_leaves_it_home_writes_nothing_and_verifies_it(mem, monkeypatch):
    """Checkpoints read disk-homed states with ``to_tensor``: it must not move the chunk (a move
    there and back rewrote every byte and needed host room), and must still check every page."""
    import tiertrain.memory.disk as disk

    neighbour = mem.from_tensor("n", random_bytes(PS // 3, 1), Tier.DISK)
    data = random_bytes(3 * PS + 77, 2)
    chunk = mem.from_tensor("c", data, Tier.DISK)
    writes = []
    monkeypatch.setattr(disk.DiskPool, "write_page", lambda self, page, d: writes.append(page))
    host_before = mem.accounting.live(Tier.HOST)
    assert torch.equal(mem.to_tensor(chunk), data) and torch.equal(mem.to_tensor(neighbour), random_bytes(PS // 3, 1))
    assert chunk.tier is Tier.DISK and writes == [] and mem.accounting.live(Tier.HOST) == host_before
    pool = mem.pool(Tier.DISK)
    offset = chunk.extents[-1].page * PS + 5
    with open(pool.file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(DiskError, match="checksum mismatch"):
        mem.to_tensor(chunk)


@pytest.mark.parametrize("fault", ["short", "eio"])
def test_short_reads_and_eio_raise_with_file_and_offset(mem, monkeypatch, fault):
    import errno

    import tiertrain.memory.disk as disk

    chunk = mem.from_tensor("c", random_bytes(PS), Tier.DISK)
    real = os.preadv

    def faulty(fd, buffers, offset):
        if fault == "eio":
            raise OSError(errno.EIO, "Input/output error")
        return min(real(fd, buffers, offset), 512) if offset % PS == 0 else 0  # 512 bytes, then end of file

    monkeypatch.setattr(disk.os, "preadv", faulty)
    pattern = "short read from .* at offset" if fault == "short" else "EIO"
    with pytest.raises(DiskError, match=pattern):
        mem.move(chunk, Tier.HOST).wait()
    monkeypatch.setattr(disk.os, "preadv", real)
    assert torch.equal(mem.to_tensor(chunk), random_bytes(PS))  # the data on disk is still good


def test_disk_files_are_private_and_removed_on_close(tmp_path):
    root = tmp_path / "disk"
    m = MemorySystem(Budgets(device=PS, host=PS, disk=4 * PS, disk_dir=str(root)), page_size=PS)
    pool = m.pool(Tier.DISK)
    run_dir = pool.dir.path
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for f in run_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    m.close()
    assert not run_dir.exists() and list(root.iterdir()) == []


def test_stale_files_of_a_sigkilled_run_are_removed_by_the_next(tmp_path):
    import signal
    import subprocess
    import sys

    root = tmp_path / "disk"
    code = (f"import sys, time\nfrom tiertrain.memory import *\n"
            f"m = MemorySystem(Budgets(device={PS}, host={PS}, disk={8 * PS}, disk_dir={str(root)!r}), page_size={PS})\n"
            "print(m.pool(Tier.DISK).dir.path, flush=True)\ntime.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    stale = child.stdout.readline().strip()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert os.path.isdir(stale)
    with MemorySystem(Budgets(device=PS, host=PS, disk=4 * PS, disk_dir=str(root)), page_size=PS) as m:
        assert [str(p) for p in m.pool(Tier.DISK).dir.stale_removed] == [stale]
        assert not os.path.exists(stale)
        # A live run's directory is never taken for stale.
        with MemorySystem(Budgets(device=PS, host=PS, disk=4 * PS, disk_dir=str(root)), page_size=PS) as other:
            assert other.pool(Tier.DISK).dir.stale_removed == []
            assert m.pool(Tier.DISK).dir.path.exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount failed'}); needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_refused_at_reservation(small_tmpfs):
    with pytest.raises(DiskError, match=rf"cannot reserve 4\.00 MiB for the disk tier in {small_tmpfs}.*ENOSPC"):
        # check_machine=False: past the capacity check (free space can go between it and the reservation)
        MemorySystem(Budgets(device=PS, host=PS, disk=64 * PS, disk_dir=str(small_tmpfs)), page_size=PS,
                     check_machine=False)


def test_enospc_mid_write_raises_cleanly_and_nothing_half_written_is_used(small_tmpfs):
    with MemorySystem(Budgets(device=PS, host=64 * PS, disk=64 * PS, disk_dir=str(small_tmpfs)),
                      page_size=PS, reserve_disk=False, check_machine=False) as m:
        data = random_bytes(32 * PS)  # 2 MiB onto a 1 MiB filesystem
        chunk = m.from_tensor("c", data, Tier.HOST)
        with pytest.raises(DiskError, match="ENOSPC"):
            m.move(chunk, Tier.DISK).wait()
        assert chunk.tier is Tier.HOST and torch.equal(m.to_tensor(chunk), data)
        disk = m.pool(Tier.DISK)
        assert m.accounting.live(Tier.DISK) == 0 and disk.used_bytes == 0 and not disk._checksums


def test_only_the_chunks_own_bytes_reach_the_disk(mem):
    """A chunk ending mid-page shares that page with the next chunk; the disk write of its last,
    partial page must be padded with zeros, never with the neighbour's bytes (which may change
    while the write is in flight and would then fail the checksum)."""
    a = mem.from_tensor("a", random_bytes(PS + 100, 3), Tier.HOST)
    b = mem.from_tensor("b", torch.full((2 * PS,), 0xFF, dtype=torch.uint8), Tier.HOST)
    assert b.extents[0].page == a.extents[-1].page  # b starts in a's last page
    mem.move(a, Tier.DISK).wait()
    pool = mem.pool(Tier.DISK)
    last = a.extents[-1].page * PS
    with open(pool.file, "rb") as f:
        f.seek(last)
        page = f.read(4096)
    assert page[:100] == bytes(random_bytes(PS + 100, 3)[PS:].tolist())
    assert page[100:] == bytes(4096 - 100)
    assert torch.equal(mem.to_tensor(b), torch.full((2 * PS,), 0xFF, dtype=torch.uint8))


def test_the_disk_queue_serves_reads_before_write_backs_and_hands_errors_to_the_waiter():
    """Reads are on the step's critical path, write-backs are not: queued reads go first, each kind
    in order of arrival; a failing request's error reaches whoever waits on it; close runs what is left."""
    import threading

    from tiertrain.memory.io_queue import READ, WRITE, PriorityPool

    pool, gate, ran = PriorityPool(1, "test-io"), threading.Event(), []
    pool.submit(gate.wait, READ)  # holds the only worker while the rest queues up
    futures = [pool.submit(lambda k=k: ran.append(k), prio) for k, prio in
               [("w1", WRITE), ("r1", READ), ("w2", WRITE), ("r2", READ)]]
    failing = pool.submit(lambda: 1 / 0, WRITE)
    gate.set()
    pool.shutdown(wait=True)
    assert ran == ["r1", "r2", "w1", "w2"] and all(f.done() for f in futures)
    with pytest.raises(ZeroDivisionError):
        failing.result()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_with_a_write_share_write_backs_go_beside_waiting_reads_never_more_than_the_share_at_once():
    """A disk measured to serve reads and writes together faster gets a write share: that many workers
    may take write-backs while reads wait, and the others keep taking reads."""
    import threading

    from tiertrain.memory.io_queue import READ, WRITE, PriorityPool

    pool, ran = PriorityPool(2, "test-io", write_share=1), []
    read_gate, write_gate = threading.Event(), threading.Event()

    def job(name: str, gate: threading.Event | None = None):
        def run() -> None:
            ran.append(name)
            if gate is not None:
                assert gate.wait(10)
        return run

    pool.submit(job("r1", read_gate), READ)   # one worker held by a read
    pool.submit(job("w1", write_gate), WRITE)  # the other takes the write-back though reads wait
    later = [pool.submit(job("w2"), WRITE)] + [pool.submit(job(f"r{k}"), READ) for k in (2, 3, 4)]
    read_gate.set()
    for f in later:  # the freed worker takes the reads first: the one write allowed is still running
        f.result(timeout=10)
    write_gate.set()
    pool.shutdown(wait=True)
    assert set(ran[:2]) == {"r1", "w1"} and ran[2:] == ["r2", "r3", "r4", "w2"]


def test_the_disk_depth_is_measured_with_python_running_beside_the_requests(tmp_path, monkeypatch):
    """A step's main thread runs Python while the disk tier's workers wait for the interpreter's lock
    between requests: the depth a run needs is measured so, not on an idle interpreter."""
    import threading

    from tiertrain.measure import disk_depth
    from tiertrain.measure.disk import DiskRates

    def beside() -> bool:
        return any(t.name == "tiertrain-depth-python" and t.is_alive() for t in threading.enumerate())

    seen = []

    def measure(directory, page, total, depth, verify=False):
        seen.append(beside())
        rate = 1e9 * depth  # rising past any depth: the tier still keeps at most 8 in flight
        return DiskRates(rate, rate, 0.0)

    def together(directory, page, total, depth):
        seen.append(beside())
        return 1e9, 1e9

    monkeypatch.setattr(disk_depth, "measure_disk", measure)
    monkeypatch.setattr(disk_depth, "together_rate", together)
    found = disk_depth.measure_depth(tmp_path, 1 << 20)
    assert len(seen) == 2 * len(disk_depth.DEPTHS) + 2 and all(seen), seen
    assert (found.depth, found.write_share) == (8, 0) and not beside()

    def failing(*a, **k):
        raise DiskError("the disk went away")

    monkeypatch.setattr(disk_depth, "measure_disk", failing)
    with pytest.raises(DiskError):
        disk_depth.measure_depth(tmp_path, 1 << 20)
    assert not beside()  # the thread beside stops whatever the measurement did


def test_the_disk_depth_is_the_plateaus_smallest_and_writes_share_only_where_together_is_faster(tmp_path,
                                                                                                 monkeypatch):
    from tiertrain.measure import disk_depth

    curve = {1: 0.5e9, 2: 0.9e9, 4: 1.2e9, 8: 1.24e9, 16: 1.25e9}
    assert disk_depth.choose(curve, together_bps=2.0e9, apart_bps=1.2e9) == (4, 2)
    assert disk_depth.choose(curve, together_bps=1.2e9, apart_bps=1.2e9) == (4, 0)
    assert disk_depth.choose({1: 1e9, 2: 0.9e9}, together_bps=9e9, apart_bps=1e9) == (1, 0)  # one: no share
    assert min(disk_depth.DEPTHS) == 2  # the tier never measures, nor runs, a single worker
    found = disk_depth.measure_depth(tmp_path, 64 << 10, total=2 << 20)  # a real, tiny measurement
    assert found.depth in disk_depth.DEPTHS and found.together_bps > 0 and found.apart_bps > 0
    assert not [p for p in tmp_path.iterdir()]  # its files are gone
    first = disk_depth.measured_depth(str(tmp_path), 64 << 10, total=2 << 20)
    monkeypatch.setattr(disk_depth, "measure_depth", lambda *a, **k: pytest.fail("measured twice"))
    assert disk_depth.measured_depth(str(tmp_path), 64 << 10) == first  # cached per disk and page size
    assert disk_depth.disk_io_for(False, str(tmp_path), 64 << 10) == disk_depth.DEFAULT_IO  # a given page size
    io = disk_depth.disk_io_for(True, str(tmp_path), 64 << 10)
    assert (io.depth, io.write_share) == (first.depth, first.write_share)
    for share, gain in ((2, 1.2), (0, 1.0)):  # the simulator's gain only where writes go beside reads
        found = disk_depth.DiskDepth(4, share, {2: 1e9, 4: 2e9, 8: 2e9}, together_bps=2.4e9, apart_bps=2.0e9)
        monkeypatch.setattr(disk_depth, "measured_depth", lambda *a, found=found: found)
        assert disk_depth.disk_io_for(True, str(tmp_path), 64 << 10) == disk_depth.DiskIO(4, share, pytest.approx(gain))
    monkeypatch.setenv("TIERTRAIN_IO_WORKERS", "3")
    assert disk_depth.disk_io_for(True, str(tmp_path), 64 << 10) == disk_depth.DiskIO(3)
    monkeypatch.delenv("TIERTRAIN_IO_WORKERS")
    monkeypatch.setattr(disk_depth, "measured_depth", lambda *a: (_ for _ in ()).throw(DiskError("disk gone")))
    assert disk_depth.disk_io_for(True, str(tmp_path), 64 << 10) == disk_depth.DEFAULT_IO  # a failing probe
    monkeypatch.setenv("TIERTRAIN_IO_WORKERS", "many")
    with pytest.raises(ConfigError, match="TIERTRAIN_IO_WORKERS"):
        disk_depth.disk_io_for(True, str(tmp_path), 64 << 10)


def _mapping_of(addr: int) -> tuple[int, set[str]]:
    """(resident KiB, VmFlags) of the mapping holding ``addr``, from /proc/self/smaps."""
    rss, found = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= addr < hi
        elif found and head == "Rss:":
            rss = int(line.split()[1])
        elif found and head == "VmFlags:":
            return rss, set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_closed_host_pool_gives_its_pages_back_while_views_of_it_live_and_is_never_counted_at_fork():
    """A model's parameters (views of its slots) can outlive the run in a reference cycle: the pool's
    pages must be freed at close, not when the garbage collector finds the cycle. And a budget already
    held against the machine must not be counted again at every fork (mapped MAP_NORESERVE: ``nr``)."""
    from tiertrain.memory.pool import MemoryPool

    pool = MemoryPool(Tier.HOST, 64 << 20, 1 << 20, torch.device("cpu"))
    view = pool.buffer[: 64 << 20]
    view.fill_(1)
    addr = view.data_ptr()
    rss, flags = _mapping_of(addr)
    strict = open("/proc/sys/vm/overcommit_memory").read().strip() == "2"  # the kernel then ignores the flag
    assert rss >= 60 << 10 and ("nr" in flags or strict), (rss, flags)
    pool.close()
    rss, _ = _mapping_of(addr)  # still mapped: the view holds it
    assert rss < 1 << 10, rss
    assert int(view[: 1 << 20].sum()) == 0  # what a view reads after close


class _FakeCudart:
    """CUDA's runtime as ``HostRegion`` calls it, recording what is pinned (CUDA refuses an address
    that is registered already, error 712, as this does)."""

    def __init__(self):
        self.pinned: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr))
        if ptr in self.pinned:
            return 712
        self.pinned[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0 if self.pinned.pop(ptr, None) is not None else 713


def test_pinned_host_memory_is_unpinned_once_before_it_can_be_unmapped(monkeypatch):
    """Seen on an H100: a pinned buffer dropped without unpinning (a page-size probe's) left its address
    registered, and the host pool the kernel mapped there next could not be pinned. Each region is
    unpinned when dropped or at its pool's close, once, and its unpin holds its mapping (so the mapping
    cannot be unmapped before it)."""
    import gc

    from tiertrain.memory import pool as pool_mod
    from tiertrain.memory.pool import MemoryPool, host_buffer

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    maps, unpinned_with = [], []
    real = pool_mod._unregister
    monkeypatch.setattr(pool_mod, "_unregister", lambda ptr, mapping: (unpinned_with.append(id(mapping)),
                                                                      real(ptr, mapping)))
    for _ in range(3):  # dropped: a probe's buffer
        buf, region = host_buffer(1 << 20, pin=True)
        assert region.pinned and fake.pinned == {buf.data_ptr(): 1 << 20}
        maps.append(id(region.map))
        del buf, region
        gc.collect()
        assert fake.pinned == {}
    pool = MemoryPool(Tier.HOST, 4 << 20, 1 << 20, torch.device("cpu"))
    assert pool.pinned and len(fake.pinned) == 1
    maps.append(id(pool._region.map))
    view = pool.buffer[:16]
    pool.close()
    assert fake.pinned == {} and view.sum() == 0  # unpinned at close; the view still reads (zeros)
    del pool, view
    gc.collect()
    unpins = [c for c in fake.calls if c[0] == "unregister"]
    assert len(unpins) == 4 and unpinned_with == maps, (fake.calls, unpinned_with, maps)


def test_a_disk_chunk_read_into_a_tensor_on_the_read_workers_lands_whole_and_verified(mem):
    """``read_into_async`` (a sharded block's shard read into its slot off the step's thread): the bytes
    of a chunk that shares its first page with another, into a tensor of its length; a flipped byte
    of one of its pages raises from the handle's ``wait``, naming the file."""
    mem.from_tensor("n", random_bytes(PS // 3, 1), Tier.DISK)
    data = random_bytes(3 * PS + 77, 2)
    chunk = mem.from_tensor("c", data, Tier.DISK)
    out = torch.zeros(data.numel(), dtype=torch.uint8)
    mem.read_into_async(chunk, out).wait()
    assert torch.equal(out, data) and chunk.tier is Tier.DISK
    pool = mem.pool(Tier.DISK)
    offset = chunk.extents[1].page * PS + 9
    with open(pool.file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(DiskError, match=f"checksum mismatch in {pool.file}"):
        mem.read_into_async(chunk, torch.zeros_like(out)).wait()
