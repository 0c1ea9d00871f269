#!/usr/bin/env bash
# Run HERE (not on the GPU machine, which reaches no package registry): fetch the wheels tiertrain
# and its peers need there and its image may lack into .whl/ (ignored by git; pass carry [".whl"]
# to the device run). The GPU image has torch, numpy, safetensors, click, rich, PyYAML, pytest and
# transformers already; gpu_check.sh installs from .whl only what is missing there.
#   crc32c: tiertrain's page checksums.
#   deepspeed (+ its pure-Python and small binary dependencies): the peer in `bench peers`.
#     It ships as source only, so it is built here into a py3-none-any wheel with DS_BUILD_OPS=0
#     (no compiled ops: the peer uses torch's fused AdamW; ZeRO-Infinity's aio op, for the NVMe stage,
#     is built just in time there, against the libaio fetched below).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
WHL=$PWD/.whl
download() {  # binary wheels for the GPU image's CPython 3.12 on x86-64 Linux
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
}
download crc32c==2.9.post0
download einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0 \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    typing-extensions==4.16.0 tqdm==4.70.1 packaging==26.2
# libaio for DeepSpeed's aio op (its NVMe offload): Debian's packages, unpacked aside there by gpu_check.sh
if command -v apt-get >/dev/null && ! compgen -G ".whl/deb/libaio-dev_*.deb" >/dev/null; then
    mkdir -p .whl/deb
    (cd .whl/deb && apt-get download -q libaio1 libaio-dev 2>&1 | grep -v "unsandboxed as root" || true)
fi
if ! compgen -G ".whl/deepspeed-*.whl" >/dev/null; then
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary=:all: deepspeed==0.19.8 -d "$src"
    tar -xzf "$src"/deepspeed-*.tar.gz -C "$src"
    # setup.py imports torch, so build with this environment's torch rather than an isolated one
    (cd "$src"/deepspeed-0.19.8 && DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WHL" .)
fi
ls -l .whl
