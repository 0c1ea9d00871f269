"""One rank of the two-node hybrid sharding check (tests/test_hybrid_link.py): started inside a network
namespace, gloo bound to the veth that joins it to the other "node". Trains a few steps hybrid (2 x 2:
sharded inside a node, replicated across), then flat (sharded over all 4), counting what each rank's
groups sent per step; rank 0 reads the veth's byte counters between steps, every rank stopped at a
barrier. Writes rank{R}.json into the directory given."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dp_harness import WIDE, rank_disk

STEPS = int(os.environ.get("HYBRID_LINK_STEPS", "4"))


def _counters(iface: str) -> int:
    stats = Path("/sys/class/net") / iface / "statistics"
    return sum(int((stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def _run(layout: str, rank: int, out: Path) -> dict:
    import tiertrain
    from tiertrain.memory import Budgets
    from tiertrain.models import build
    from tiertrain.plan import builtin_plan, data_parallel
    from tiertrain.train.objective import lm_loss
    from tiertrain.train.optimizer import make_adamw

    torch.manual_seed(0)
    model = build(WIDE)
    opt, _ = make_adamw(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    plan = data_parallel(builtin_plan("stream", WIDE["n_layer"]), 4, shard_group=2 if layout == "hybrid" else 0)
    tm, topt = tiertrain.setup(model, opt, Budgets(64 << 20, 64 << 20, 64 << 20, rank_disk(out / layout, rank)),
                               plan=plan, page_size=64 << 10)
    rt = tm.runtime
    row = {"wire": [], "across": [], "losses": [], "seconds": []}
    groups = rt.shards.replicas if layout == "hybrid" else None
    try:
        for step in range(STEPS):
            batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(100 * step + rank))
            dist.barrier()
            wire, sent = _counters(os.environ["GLOO_SOCKET_IFNAME"]), groups.sent if groups else 0
            start = time.perf_counter()
            loss = lm_loss(tm, batch[:, :-1], batch[:, 1:])
            loss.backward()
            topt.step()
            topt.zero_grad()
            dist.barrier()
            row["seconds"].append(time.perf_counter() - start)
            row["wire"].append(_counters(os.environ["GLOO_SOCKET_IFNAME"]) - wire)
            row["across"].append((groups.sent if groups else 0) - sent)
            row["losses"].append(loss.item())
        return row
    finally:
        rt.close()
        rt.mem.close()


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        result = {layout: _run(layout, rank, out) for layout in ("hybrid", "flat")}
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
