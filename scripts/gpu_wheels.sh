#!/usr/bin/env bash
# Run HERE (not on the GPU machine, which reaches no package registry): fetch the wheels tiertrain
# needs there and its image lacks into .whl/ (ignored by git; pass carry [".whl"] to the device run).
# The GPU image has torch, numpy, safetensors, click, rich, PyYAML, pytest and transformers already.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl crc32c==2.9.post0
ls -l .whl
