#!/usr/bin/env bash
# The README's test command: the whole suite, Kubernetes tests included.
# PYTHONSAFEPATH keeps the repo root off sys.path, so `plimsoll` resolves to the
# installed package (whose operator/runtime/... folders are mapped in) rather
# than the bare plimsoll/ folder of the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1
exec python3 -m pytest "$@"
