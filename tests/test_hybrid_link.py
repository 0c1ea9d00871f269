"""Hybrid sharding over two "nodes": two network namespaces joined by a veth pair (as
scripts/slow_link_bench.sh joins them), two ranks in each, gloo bound to the veth. What crosses between
the nodes per step, counted on the veth itself, is what the formula says crosses: each shard's gradient
all-reduce and the has-gradient flags (the ranks' ``replicas.sent``), plus the transport's framing; the
gathers and reduce-scatters stay inside each node. The same ranks sharding flat over all four send
several times as much across. Needs root (namespaces) and iproute2; skipped elsewhere."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FRAMING = 1.12          # TCP/IP headers (66 B per 1448 B segment: 4.6%) and ACKs (66 B per two segments)
FIXED = 32 << 10        # per step: the barriers around it, heartbeats to the store (one a second per rank)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for two network namespaces")
    tag = os.getpid() % 100000
    ns, veth = (f"tt-hyb-a{tag}", f"tt-hyb-b{tag}"), (f"tthya{tag}", f"tthyb{tag}")
    try:
        for n in ns:
            _ip("netns", "add", n)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for k, n in enumerate(ns):
            _ip("link", "set", veth[k], "netns", n)
            _ip("-n", n, "addr", "add", f"10.78.0.{k + 1}/24", "dev", veth[k])
            _ip("-n", n, "link", "set", "lo", "up")
            _ip("-n", n, "link", "set", veth[k], "up")
    except subprocess.CalledProcessError as exc:
        _remove(ns)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode().strip()}")
    out = tmp_path_factory.mktemp("hybrid-link")
    try:
        yield _launch(ns, veth, out)
    finally:
        _remove(ns)


def _launch(ns: tuple[str, str], veth: tuple[str, str], out: Path) -> dict:
    env = {**os.environ, "WORLD_SIZE": "4", "MASTER_ADDR": "10.78.0.1", "MASTER_PORT": str(29600 + os.getpid() % 300),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for rank in range(4):
        node = rank // 2
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns[node], sys.executable, str(HERE / "hybrid_link_worker.py"), str(out)],
            env={**env, "RANK": str(rank), "GLOO_SOCKET_IFNAME": veth[node]},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        raise AssertionError("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)}


def _remove(ns: tuple[str, str]) -> None:
    for n in ns:
        pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", n], capture_output=True)  # takes its end of the veth pair with it


def test_bytes_between_the_nodes_per_step_are_the_shards_all_reduces_and_flat_sharding_sends_more(two_nodes):
    hybrid, flat = two_nodes[0]["hybrid"], two_nodes[0]["flat"]
    for step in range(1, len(hybrid["wire"])):  # step 0 also carries the groups' first connections
        formula = sum(two_nodes[r]["hybrid"]["across"][step] for r in range(4))
        wire = hybrid["wire"][step]
        print(f"step {step}: {wire:,} B crossed the veth; formula {formula:,} B (x{wire / formula:.3f}); "
              f"flat sharding over 4 ranks: {flat['wire'][step]:,} B")
        assert formula <= wire <= FRAMING * formula + FIXED, (step, wire, formula)
        assert flat["wire"][step] > 2 * wire, (step, flat["wire"][step], wire)
    for r in range(4):  # both layouts train the same model on the same batches: the sums differ in order only
        got, flat_losses = two_nodes[r]["hybrid"]["losses"], two_nodes[r]["flat"]["losses"]
        assert got[0] == flat_losses[0] and got == pytest.approx(flat_losses, rel=1e-5, abs=0), (r, got, flat_losses)
