#!/usr/bin/env bash
# Run plimsoll's GPU check on a machine with one CUDA GPU, from any directory:
#   bash scripts/gpu_check.sh [--part offline|server|all] [--cpu] [--budget-s N] [--sections a,b] [more args]
#   bash scripts/gpu_check.sh --sections roofline --part offline --budget-s 540   # gpu_roofline.py
#   bash scripts/gpu_check.sh --prepare   # here, before: SmolLM2's tokenizer and wheels into build/gpu-check
#   bash scripts/gpu_check.sh --help      # the parts, their sections, and the command for a lent GPU
# --part offline runs scripts/gpu_check.py (kernels, parity, decode figures); --part server
# runs scripts/gpu_server_check.py (`plimsoll serve` on the GPU over HTTP, 64 clients, every
# API feature, chi-square of the sampler, sampled vs greedy tok/s, RoPE at 4k tokens, KV
# sizing by --gpu-memory-utilization); all (the default) runs both, server first. --cpu runs
# them on small models on this CPU (checks the scripts; no GPU behaviour is shown). Other
# arguments (--budget-s, --sections: names a script does not know are ignored by it) go to
# the scripts. Prints versions, makes `plimsoll` importable without installing it (the GPU
# machine may be offline, so no pip). Figures go to stdout and, when $OUT is set, to
# $OUT/gpu_check.json and $OUT/gpu_server_check.json. The exit status is non-zero when a
# section fails or a check does not hold.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
PART=all
CPU=0
ARGS=()
# --prepare downloads the wheels of what the server check imports beyond torch and
# transformers, with their dependencies (CPython 3.12 and pure Python), into
# build/gpu-check/wheels; a machine that lacks one of those distributions installs its
# wheel from there into build/gpu-check/site (no network, no resolving: the wheels were
# resolved together when they were downloaded).
usage() {
  # This file's header, then each script's own list of sections (read from its docstring, so
  # the help needs neither torch nor a GPU), then how a lent GPU runs it.
  sed -n '2,/^set -uo/p' "$REPO/scripts/gpu_check.sh" | sed '$d' | sed 's/^# \{0,1\}//'
  for script in gpu_server_check.py gpu_check.py; do
    echo
    echo "=== scripts/$script (--part $( [ "$script" = gpu_check.py ] && echo offline || echo server)) ==="
    "$PY" -c 'import ast, sys; print(ast.get_docstring(ast.parse(open(sys.argv[1]).read())))' "$REPO/scripts/$script"
  done
  cat <<'HELP'

=== on a lent GPU (the device run tool: 15 minutes of device time, 10 a command) ===
Here, once (downloads SmolLM2's tokenizer from the embedded model's cache and the serving
stack's wheels for the GPU machine's Python into build/gpu-check, an ignored path):
    bash scripts/gpu_check.sh --prepare
Then one command on the device, carrying that folder, with time left to rerun it:
    run(command="bash scripts/gpu_check.sh --part server --budget-s 400",
        carry=["build/gpu-check"], timeout_s=540)
It runs the sampler's chi-square, the server section (64 openai clients, every API feature
against a CPU reference), sampled vs greedy tok/s at c=64 and the KV line on the card first,
then the other sections while the budget lasts; the JSON lands in $OUT/gpu_server_check.json.
The offline part (kernels, parity, decode) is a second command if time is left:
    run(command="bash scripts/gpu_check.sh --part offline --budget-s 300", timeout_s=420)
Check the scripts themselves on this CPU first (small models; shows no GPU behaviour):
    bash scripts/gpu_check.sh --part server --cpu --sections sampler,server
HELP
}
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --part) PART="$2"; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --prepare)
      # SmolLM2's tokenizer, from the embedded model's cache, where the run tool carries it
      # (an ignored path: run(..., carry=["build/gpu-check"])).
      SRC="${PLIMSOLL_SMOLLM2_DIR:-${PLIMSOLL_CACHE_DIR:-$HOME/.cache/plimsoll/models}/smollm2-135m-instruct}"
      mkdir -p build/gpu-check/smollm2-tokenizer
      for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
        [ -f "$SRC/$f" ] && cp "$SRC/$f" build/gpu-check/smollm2-tokenizer/
      done
      [ -f build/gpu-check/smollm2-tokenizer/tokenizer.json ] || { echo "no tokenizer.json in $SRC"; exit 2; }
      echo "prepared build/gpu-check/smollm2-tokenizer from $SRC"
      TARGET=(--only-binary=:all: --implementation cp --python-version 3.12 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d build/gpu-check/wheels)
      # The serving stack with its dependencies resolved (pydantic pins its core); peft and
      # accelerate without theirs (torch and transformers are on the machine).
      "$PY" -m pip download --quiet "${TARGET[@]}" typer rich pyyaml fastapi uvicorn prometheus-client openai httpx \
        && "$PY" -m pip download --quiet --no-deps "${TARGET[@]}" peft accelerate psutil tqdm \
        || { echo "pip download failed"; exit 2; }
      echo "prepared build/gpu-check/wheels ($(du -sh build/gpu-check/wheels | cut -f1)); carry build/gpu-check"
      exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
set -- "${ARGS[@]+"${ARGS[@]}"}"
case "$PART" in offline|server|all) ;; *) echo "--part must be offline, server or all"; exit 2 ;; esac

echo "=== host ==="
"$PY" --version 2>&1 || { echo "no $PY found: set PYTHON=/path/to/python"; exit 2; }
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  echo "nvidia-smi: not found"
fi
"$PY" - <<'EOF'
import importlib
import importlib.metadata
for name in ("torch", "triton", "transformers", "safetensors", "tokenizers", "pydantic", "numpy", "openai", "httpx", "peft", "prometheus_client"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', None) or importlib.metadata.version(name)}")
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

# Packages the server check needs that this machine lacks, from the carried wheels: each wheel
# whose distribution is not installed here, by file (one that cannot install does not stop the rest).
if [ -d "$REPO/build/gpu-check/wheels" ]; then
  SITE="$REPO/build/gpu-check/site"
  MISSING="$("$PY" - "$REPO/build/gpu-check/wheels" <<'EOF'
import importlib.metadata
import pathlib
import sys

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        importlib.metadata.version(wheel.name.split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
EOF
)"
  if [ -n "$MISSING" ]; then
    echo "installing from build/gpu-check/wheels into $SITE:"
    for wheel in $MISSING; do
      echo "  $(basename "$wheel")"
      "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$wheel" \
        || echo "  $(basename "$wheel") did not install; the sections needing it will say so"
    done
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
  fi
fi

# Keep Triton 3.9's FP-fusion default explicit (silences its warning, same behaviour).
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
status=0
if [ "$PART" = server ] || [ "$PART" = all ]; then
  if [ "$CPU" = 1 ]; then set -- --device cpu "$@"; fi
  "$PY" "$REPO/scripts/gpu_server_check.py" "$@" || status=1
  if [ "$CPU" = 1 ]; then shift 2; fi
fi
if [ "$PART" = offline ] || [ "$PART" = all ]; then
  if [ "$CPU" = 1 ]; then set -- --smoke "$@"; fi
  "$PY" "$REPO/scripts/gpu_check.py" "$@" || status=1
fi
exit $status
