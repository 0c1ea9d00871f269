#!/bin/bash
# Hybrid sharding against flat sharding over an emulated slow link between two "nodes": two network
# namespaces joined by a veth pair, a token-bucket rate limit on both ends (no netem on these kernels),
# two gloo ranks in each namespace bound to the veth (tests/hybrid_link_worker.py: the 4-layer test GPT,
# streamed, each step timed between barriers). Prints, per layout, the median step and the bytes that
# crossed the veth per step. Needs root; removes what it starts on exit.
#   usage: sudo scripts/hybrid_link_bench.sh [RATE (default 1gbit)] [STEPS (default 8)]
set -euo pipefail
RATE=${1:-1gbit}
STEPS=${2:-8}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=$(mktemp -d)
source "$ROOT/scripts/two_nodes.sh"
two_nodes "$RATE" 10.79.0
trap 'remove_two_nodes; rm -rf "$OUT"' EXIT
pids=()
for rank in 0 1 2 3; do
    if [ $rank -lt 2 ]; then ns=$NS0 dev=$DEV0; else ns=$NS1 dev=$DEV1; fi
    ip netns exec "$ns" env RANK=$rank WORLD_SIZE=4 MASTER_ADDR=10.79.0.1 MASTER_PORT=29611 \
        GLOO_SOCKET_IFNAME=$dev OMP_NUM_THREADS=1 HYBRID_LINK_STEPS=$STEPS PYTHONPATH="$ROOT/tests" \
        "$PY" "$ROOT/tests/hybrid_link_worker.py" "$OUT" > "$OUT/log$rank" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { cat "$OUT"/log*; exit 1; }; done
"$PY" - "$OUT/rank0.json" "$RATE" <<'PYEOF'
import json, statistics, sys
runs = json.load(open(sys.argv[1]))
print(f"link: veth between two namespaces, tbf {sys.argv[2]} on both ends; 2 x 2 gloo ranks, 4-layer test GPT streamed")
for layout, row in runs.items():
    steps = row["seconds"][1:]  # the first carries the groups' first connections
    print(f"{layout:7s} step {statistics.median(steps) * 1e3:8.1f} ms (median of {len(steps)})   "
          f"{statistics.median(row['wire'][1:]) / 1e6:6.2f} MB across the link per step")
PYEOF
