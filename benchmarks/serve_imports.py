"""What `plimsoll serve` spends on imports before it reads its arguments: the lazy CLI against an eager one.

Runs ``plimsoll serve /nonexistent`` in fresh interpreters through the real entry point
(``plimsoll.cli.main``); the server marks the ``imports`` start-up phase once torch, the
engine and the HTTP server are loaded, then refuses the missing model and exits. Printed
per variant: the wall and CPU seconds from the interpreter's first line to that mark
(medians over ``--repeats``, run in ABAB order so a busy host hurts both alike), and their
ratio.

* ``lazy``: the CLI as it is; only the ``serve`` sub-command's module is imported.
* ``eager``: every sub-command module in ``plimsoll.cli.SUBCOMMANDS`` imported first, as a
  CLI that registers all its sub-commands up front would (bench, planner, operator,
  control plane, demo and their rich/httpx/kubernetes imports).

What it is not: the whole start-up (weights, KV cache, warm-up: ``cold_start_phases.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import time
t0, c0 = time.time(), time.process_time()
import importlib, json, sys
from plimsoll.runtime.engine.startup import STARTUP
marks = {}
original = STARTUP.mark
def mark(phase, at=None):
    marks.setdefault(phase, (time.time() - t0, time.process_time() - c0))
    original(phase, at)
STARTUP.mark = mark
from plimsoll import cli
if EAGER:
    for module, _, _ in cli.SUBCOMMANDS.values():
        importlib.import_module(module)
sys.argv = ["plimsoll", "serve", "/nonexistent/model"]
try:
    cli.main()
except SystemExit:
    pass
print("PHASES " + json.dumps(marks))
"""


def run_once(eager: bool) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.replace("EAGER", str(eager))],
        capture_output=True,
        text=True,
        check=False,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("PHASES ")), None)
    if line is None or "imports" not in line:
        raise SystemExit(f"serve never reached its imports mark:\n{out.stdout}\n{out.stderr}")
    wall, cpu = json.loads(line.removeprefix("PHASES "))["imports"]
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"eager": [], "lazy": []}
    for _ in range(args.repeats):
        for name in ("eager", "lazy"):
            results[name].append(run_once(name == "eager"))
    medians = {
        name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for name, runs in results.items()
    }
    print(f"`plimsoll serve` to its imports mark, median of {args.repeats} (ABAB), seconds")
    print(f"{'variant':8} {'wall':>8} {'cpu':>8}")
    for name, (wall, cpu) in medians.items():
        print(f"{name:8} {wall:8.2f} {cpu:8.2f}")
    (ew, ec), (lw, lc) = medians["eager"], medians["lazy"]
    print(f"lazy/eager: wall {lw / ew:.2f}x, cpu {lc / ec:.2f}x")


if __name__ == "__main__":
    main()
