#!/usr/bin/env bash
# Run plimsoll's GPU check on a machine with one CUDA GPU, from any directory:
#   bash scripts/gpu_check.sh [--budget-s 420] [--sections kernels,parity,decode-smollm2,decode-llama1b]
#   bash scripts/gpu_check.sh --sections roofline --budget-s 540   # the roofline bench (gpu_roofline.py)
# Prints versions, makes `plimsoll` importable without installing it (the GPU
# machine may be offline, so no pip), then runs scripts/gpu_check.py. Figures go to
# stdout and, when $OUT is set, to $OUT/gpu_check.json. Missing pieces (no GPU, no
# triton, no transformers) are skipped by the Python script with a line saying so.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"

echo "=== host ==="
"$PY" --version 2>&1 || { echo "no $PY found: set PYTHON=/path/to/python"; exit 2; }
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  echo "nvidia-smi: not found"
fi
"$PY" - <<'EOF'
import importlib
for name in ("torch", "triton", "transformers", "safetensors", "tokenizers", "pydantic", "numpy"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as exc:
        print(f"{name}: MISSING ({type(exc).__name__}: {exc})")
EOF

# plimsoll maps top-level folders to subpackages (runtime/ -> plimsoll.runtime) via
# setuptools package-dir. Without an install, mirror that mapping with symlinks.
if ! "$PY" -c "import plimsoll.runtime.attention.triton_backend" >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir "$SHIM/plimsoll"
  for f in "$REPO"/common/*; do ln -s "$f" "$SHIM/plimsoll/"; done
  for part in runtime bench router devcluster; do
    [ -d "$REPO/$part" ] && ln -s "$REPO/$part" "$SHIM/plimsoll/$part"
  done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  echo "plimsoll: not installed, importing from $REPO through $SHIM"
else
  echo "plimsoll: installed"
fi

# Keep Triton 3.9's FP-fusion default explicit (silences its warning, same behaviour).
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
exec "$PY" "$REPO/scripts/gpu_check.py" "$@"
