#!/usr/bin/env bash
# The README's test command: the whole suite, Kubernetes tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest "$@"
