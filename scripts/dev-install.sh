#!/usr/bin/env bash
# Re-link the editable install (strict mode links files that exist at install
# time, so run this after adding a module). Serialised with flock so parallel
# callers do not trip over each other's build/ tree.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/plimsoll-dev-install.lock \
  python3 -m pip install --quiet --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
