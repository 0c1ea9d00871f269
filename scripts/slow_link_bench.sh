#!/bin/bash
# Data parallel over an emulated slow link: two network namespaces joined by a veth pair, one torchrun
# node in each, a token-bucket rate limit on both ends (these kernels have no netem), gloo bound to the
# veth. Prints bench parallel's figures (dp=2 across the link against dp=1 in the first namespace) for
# each layout. Needs root. Everything it starts (namespaces, processes) is removed on exit.
#   usage: sudo scripts/slow_link_bench.sh [RATE (default 1gbit)] [LAYOUTS (default "ddp zero2 zero3")]
set -euo pipefail
RATE=${1:-1gbit}
LAYOUTS=${2:-"ddp zero2 zero3"}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
CONFIG=${CONFIG:-'{"steps": 5, "threads": 1}'}
source "$(dirname "$0")/two_nodes.sh"
two_nodes "$RATE" 10.77.0
node() {  # node RANK NS IFACE LAYOUT
    ip netns exec "$2" env GLOO_SOCKET_IFNAME="$3" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
        "$PY" -m torch.distributed.run --nnodes 2 --node-rank "$1" --nproc-per-node 1 \
        --master-addr 10.77.0.1 --master-port 29577 -m tiertrain.bench.parallel --worker --layout "$4" \
        --config "$CONFIG"
}
RUNS=$(mktemp)
for layout in $LAYOUTS; do
    node 1 "$NS1" "$DEV1" "$layout" > /dev/null 2>&1 &
    node 0 "$NS0" "$DEV0" "$layout" 2>/dev/null | sed -n "s/^tiertrain-bench-parallel /$layout 2 /p" >> "$RUNS"
    wait
    ip netns exec "$NS0" env OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m tiertrain.bench.parallel --worker --layout "$layout" --config "$CONFIG" 2>/dev/null \
        | sed -n "s/^tiertrain-bench-parallel /$layout 1 /p" >> "$RUNS"
done
echo "link: veth between two namespaces, tbf rate $RATE on both ends"
"$PY" -m tiertrain.bench.parallel --report "$RUNS"
rm -f "$RUNS"
