#!/usr/bin/env bash
# Create .venv and install tiertrain into it, editable.
#
# Reuses an installed torch (the venv sees system site-packages); installs
# torch==2.13.0 only when no torch is importable. The exact pin matters: a looser
# spec makes pip resolve a CUDA build and fetch gigabytes.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh test     plus pytest and transformers
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras="${1:-}"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: no torch found, installing torch==2.13.0 (CPU build)"
  .venv/bin/pip install --quiet torch==2.13.0 2>&1 | { grep -v "is ignored: it is neither" || true; }
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
if ! .venv/bin/pip install --quiet --disable-pip-version-check -e "$spec" > .venv/pip.log 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" .venv/pip.log >&2
  echo "setup: pip install failed (full log in .venv/pip.log)" >&2
  exit 1
fi
.venv/bin/python -c "import torch, tiertrain; print(f'setup: tiertrain {tiertrain.__version__} with torch {torch.__version__}')"
