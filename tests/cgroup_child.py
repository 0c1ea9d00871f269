"""Trains a GPT whose model states are far larger than this process may hold; run under a cgroup cap.

argv: DISK_DIR N_LAYER. Prints one line per step and a final JSON line with the run's figures.
"""

import json
import resource
import sys
import time

import torch

import tiertrain
from tiertrain.engine.objective import lm_loss
from tiertrain.memory import Budgets, Tier
from tiertrain.models import ModelConfig, build, param_count
from tiertrain.plan import BlockPlan, Plan


def config(layers: int) -> ModelConfig:
    return ModelConfig(n_layer=layers, n_head=12, d_model=768, d_ffn=3072, vocab_size=256, max_seq_len=64,
                       name="cgroup")


def main() -> None:
    disk_dir, layers = sys.argv[1], int(sys.argv[2])
    cfg = config(layers)
    torch.manual_seed(0)
    model = build(cfg, device="meta")  # nothing allocated: setup initialises block by block
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # only its hyperparameters are read
    plan = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in range(layers)), BlockPlan(home=Tier.DISK),
                window=2, prefetch=1, update="overlap", read_ahead=1, update_workers=1, name="disk-home")
    budgets = Budgets(device=128 << 20, host=400 << 20, disk=7 << 30, disk_dir=disk_dir)
    t = time.time()
    tm, topt = tiertrain.setup(model, opt, budgets, plan=plan, page_size=1 << 20)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"setup {time.time() - t:.1f} s, peak rss {rss:.0f} MiB", flush=True)
    x = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(2):
        t = time.time()
        loss = lm_loss(tm, x[:, :-1], x[:, 1:])
        loss.backward()
        topt.step()
        topt.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1} loss {losses[-1]:.4f} ({time.time() - t:.1f} s)", flush=True)
    tm.runtime.close()
    stats = tm.runtime.mem.stats()
    tm.runtime.mem.close()
    print(json.dumps({"params": param_count(cfg), "losses": losses,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "peaks": {t: v["peak"] for t, v in stats.items() if "budget" in v}}), flush=True)


if __name__ == "__main__":
    main()
