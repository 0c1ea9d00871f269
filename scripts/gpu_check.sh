#!/usr/bin/env bash
# The GPU half of the checks, in one call on a lent GPU machine (issue 4's "Measure" list):
#   run (device tool): command "bash scripts/gpu_check.sh [STAGE ...]", carry [".whl"], timeout_s 600
# after `bash scripts/gpu_wheels.sh` here. Stages: cuda_tests peers_disk overhead large offload planner
# probe largest peers (default: all). Together their limits pass one call's 10 minutes: split them over three calls,
# e.g. "cuda_tests peers_disk", "overhead large offload", then "planner peers".
# Each stage's log goes to $OUT (fetched back); a stage that fails is reported and the next one
# still runs. Sizes suit an 80 GiB H100/H200. GPU_DEADLINE=SECONDS: every stage ends by then (its limit
# cut to what is left; one with under 20 s left is skipped), so one call fits its device time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
status=0
wanted=" ${*:-cuda_tests peers_disk overhead large probe largest offload planner peers} "
deadline=$((SECONDS + ${GPU_DEADLINE:-100000}))
stage() {  # stage NAME SECONDS COMMAND...: run it with a limit, log it, remember a failure
    local name=$1 limit=$2; shift 2
    [[ $wanted == *" $name "* ]] || return 0
    local left=$((deadline - SECONDS))
    if [ $left -lt 20 ]; then echo "=== $name: skipped, ${left} s left before GPU_DEADLINE" | tee -a "$OUT/summary.log"; return 0; fi
    [ $left -lt "$limit" ] && limit=$left
    echo "=== $name" | tee -a "$OUT/summary.log"
    [ "$1" = tt ] && set -- python3 -m tiertrain.cli.main "${@:2}"  # timeout runs programs, not shell functions
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$OUT/$name.log" | tee -a "$OUT/summary.log"
    echo "=== $name: exit $rc" | tee -a "$OUT/summary.log"
    [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.log"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/summary.log"
# Wheels carried in .whl (scripts/gpu_wheels.sh). --prefix, not --target: pip then installs only
# what the image lacks, and its torch, numpy... stay. crc32c first: tiertrain needs it; DeepSpeed is a peer.
if compgen -G ".whl/*.whl" >/dev/null; then
    for pkg in crc32c deepspeed; do
        python3 -m pip install -q --no-index --no-compile --no-cache-dir --find-links .whl --prefix /tmp/site \
            "$pkg" >> "$OUT/wheels.log" 2>&1 || echo "$pkg did not install from .whl (see wheels.log)" | tee -a "$OUT/summary.log"
    done
    site=$(python3 -c 'import sysconfig as s; v = {"base": "/tmp/site", "platbase": "/tmp/site"}; print(s.get_path("purelib", vars=v) + ":" + s.get_path("platlib", vars=v))')
    export PYTHONPATH=$site:src
fi
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>/dev/null | tail -n 1 | tee -a "$OUT/summary.log"
# libaio for DeepSpeed's aio op (ZeRO-Infinity on NVMe), carried as Debian packages in .whl/deb
# (gpu_wheels.sh) where the image has none: unpacked aside, found by the compiler and the loader there
if [ ! -e /usr/include/libaio.h ] && compgen -G ".whl/deb/*.deb" >/dev/null; then
    for f in .whl/deb/*.deb; do dpkg -x "$f" /tmp/aio; done
    aio=/tmp/aio/usr/lib/x86_64-linux-gnu
    export CPATH=/tmp/aio/usr/include LIBRARY_PATH=$aio LD_LIBRARY_PATH=$aio${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export CFLAGS="-I/tmp/aio/usr/include" LDFLAGS="-L$aio"
fi
# DeepSpeed's JIT builds read the architecture list, and cannot parse the image's "9.0a": the GPU's own
export TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
# the disk tier's and the peers' files: beside the working tree (its disk), not in /tmp (maybe in RAM)
DISK=${GPU_DISK_DIR:-$PWD/.gpu-disk}
mkdir -p "$DISK" "$DISK/probe"
lscpu | grep -E '^(Model name|CPU\(s\))' | tee -a "$OUT/summary.log"
df -hT "$DISK" /tmp | tee -a "$OUT/summary.log"
# 1. correctness on CUDA: plans against plain PyTorch, pools, train with a plan (incl. auto)
stage cuda_tests 150 python3 -m pytest -v -ra --durations=5 -p no:cacheprovider tests/test_cuda.py
# 2. issue 21's comparison on this machine: a 354M GPT-2-medium-shaped model, states on disk at 512 MiB
#    device and 2 GiB host, beside DeepSpeed ZeRO-Infinity (NVMe); both may allocate 4 GiB of the GPU
stage peers_disk 330 tt bench peers --model scripts/gpt2-medium.json --batch-size 1 --seq-len 128 \
    --device-memory 512MiB --device-cap 4GiB --host-memory 2GiB --disk $DISK:40GiB \
    --peers deepspeed --update overlap --steps 5
# 3. a model that fits: overhead against plain PyTorch (target <= 3%), tokens/s, MFU
stage overhead 100 tt bench overhead --d-model 2048 --layers 12 --seq-len 256 --batch-size 32 --precision bf16 \
    --rounds 5 --steps 3
# 4. states >= 4x the device budget (1.5B params, 24 GiB of states, a 6 GiB device budget): tokens/s, TFLOPS,
#    at a batch a user would run (16 micro-batches of 4 x 1024 tokens: 65,536 tokens a step)
stage large 150 tt train --model scripts/gpu-1.5b.json --plan auto --device-memory 6GiB --host-memory 96GiB \
    --precision bf16 --batch-size 4 --grad-accum 16 --seq-len 1024 --steps 5 --log-every 1 --no-save --out /tmp/large-run
# 4a. the same model and budget at 2 micro-batches a step, its per-step phases kept (metrics.jsonl in $OUT)
stage large_trace 200 tt train --model scripts/gpu-1.5b.json --plan auto --device-memory 6GiB --host-memory 96GiB \
    --precision bf16 --batch-size 4 --grad-accum 2 --seq-len 1024 --steps 4 --lr 3e-4 --log-every 1 --no-save \
    --out $OUT/large-trace
# 4b. this machine's measured description (beside the datasheet's), cached for the stages after it
stage probe 90 tt probe --disk $DISK/probe --out $OUT/machine.json
# 4c. the largest model that really trains, at budgets one call can search (capacity bound 1.34B params)
stage largest 220 tt bench largest --device-memory 4GiB --host-memory 12GiB --disk $DISK/largest:4GiB \
    --seq-len 512 --max-trials 4 --trial-timeout 100 --update overlap --grad-clip 0 --json $OUT/largest.json
# 5. states on disk (NVMe here), the planner's fidelity on this machine
stage offload 100 tt bench offload --disk $DISK/bench-offload --d-model 1024 --layers 8 --batch-size 4 --seq-len 512
stage planner 100 tt bench planner --part fidelity --disk-dir $DISK/bench-planner --d-model 1024 --layers 8 --seq-len 512
# 5b. STRONGHOLD's multi-stream execution: every block over 1, 2, 4 CUDA streams, small kernels and large
stage streams_small 60 tt bench streams --d-model 256 --layers 8 --rows 8 --seq-len 128 --steps 8
stage streams 90 tt bench streams --d-model 1024 --layers 8 --rows 8 --seq-len 512 --steps 4
# 6. the same 1.5B model and 6 GiB device budget: tiertrain beside DeepSpeed ZeRO-3 offload and FSDP2 CPU offload
stage peers 290 tt bench peers --model scripts/gpu-1.5b.json --precision bf16 --batch-size 4 --seq-len 1024 \
    --device-memory 6GiB --host-memory 96GiB --steps 3 --warmup 1
exit $status
