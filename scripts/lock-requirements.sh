#!/usr/bin/env bash
# Regenerate requirements.lock: every dependency of plimsoll (and of its `profile` extra, py-spy)
# from PyPI, exact versions with hashes,
# for the image's Python (3.11, x86_64 glibc). torch, triton and the nvidia-* libraries are left
# out: the Dockerfile takes them from the one PyTorch index that matches the image's base (CPU or
# a CUDA version), after the locked packages, so every other package is hash-checked.
#   bash scripts/lock-requirements.sh        (needs uv: pip install uv)
set -euo pipefail
cd "$(dirname "$0")/.."
uv pip compile pyproject.toml --extra profile --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --no-emit-package torch --no-emit-package triton \
  $(uv pip compile pyproject.toml --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header \
      --no-annotate -q | sed -n 's/^\(nvidia-[a-z0-9-]*\)==.*/--no-emit-package \1/p') \
  --custom-compile-command "bash scripts/lock-requirements.sh" -o requirements.lock
