"""Process start to the first byte of `plimsoll serve`, for one or more installs side by side.

What it measures, ``--repeats`` times per install, in ABAB order so a busy host hurts each
alike: a fresh ``plimsoll serve`` process on the embedded model (or ``--model``) is spawned,
``/ready`` is polled every 20 ms, and as soon as it answers 200 one streamed greedy
completion is sent; printed per start are the seconds from the spawn to ``/ready`` and to
the first streamed byte, the server process's CPU seconds by then (less at the mercy of a busy
host than the wall clock), the server's own phases (``plimsoll_startup_phase_seconds``, from
its process start) and the answer. Each install is named ``LABEL=PYTHON`` (a virtual
environment's interpreter, e.g. one per git worktree), so a branch and ``main`` are measured
in the same run. The answers of every start are compared: the greedy text and the prompt's
token count must be the same across installs.

``--serve-args "--compilation-cache-dir DIR"`` adds arguments to every start (with that one,
the first start packs the CPU weight panels into DIR and later ones map them).

With ``--importtime N`` one more start per install runs under ``python -X importtime`` and
the N imports with the largest cumulative time before ``/ready`` are printed (the timing of
that start is not counted: ``-X importtime`` slows imports).

What it is not: a cluster measurement (``cold_start_phases.py`` adds the pod, the init step
and the router); the figures are this host's, compare the installs within one run.

    python benchmarks/serve_first_byte.py --install branch=.venv/bin/python \\
        --install main=../main/.venv/bin/python --repeats 5 --importtime 15
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from plimsoll.process_group import stop_group

PROMPT = "The capital of France is"


@dataclass
class Start:
    ready_s: float
    first_byte_s: float
    phases: dict[str, float]
    text: str
    prompt_tokens: int
    cpu_s: float  # the server process's CPU seconds (user + system) by its first byte
    log: str = field(repr=False, default="")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start_once(python: str, serve_args: list[str], importtime: bool, timeout: float) -> Start:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["-X", "importtime"] if importtime else []
    cmd = [
        python,
        *flags,
        "-c",
        "from plimsoll.cli import main; main()",
        "serve",
        "--port",
        str(port),
        *serve_args,
    ]
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(
                        f"{python} serve exited {proc.returncode}:\n{log.read().decode()[-3000:]}"
                    )
                if time.perf_counter() - t0 > timeout:
                    raise SystemExit(f"{python} serve not ready after {timeout} s")
                try:
                    if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            ready = time.perf_counter() - t0
            first, parts, usage, cpu = None, [], {}, 0.0
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line:
                        first = time.perf_counter() - t0
                        cpu = cpu_seconds(proc.pid)  # by the first byte, not by the end of the answer
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices") or []:
                            parts.append(choice.get("text") or "")
                        usage = chunk.get("usage") or usage
            assert first is not None, "no byte came back"
            phases = {}
            for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
                m = re.match(r'plimsoll_startup_phase_seconds\{.*phase="(\w+)".*\} (\S+)', line)
                if m:
                    phases[m.group(1)] = float(m.group(2))
        finally:
            stop_group(proc)
        log.seek(0)
        text = log.read().decode(errors="replace")
    return Start(ready, first, phases, "".join(parts), int(usage.get("prompt_tokens", -1)), cpu, text)


def top_imports(log: str, n: int) -> list[tuple[float, str]]:
    """The ``n`` largest cumulative import times (seconds) from ``-X importtime`` lines."""
    rows = []
    for line in log.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(2)) / 1e6, len(m.group(3)), m.group(4)))
    # Only top-level imports of each tree would double count less, but the nested ones say where
    # the time is; list the largest and show their depth.
    rows.sort(reverse=True)
    return [(s, "  " * (depth - 1) + name) for s, depth, name in rows[:n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="append", required=True, help="LABEL=PYTHON (repeatable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    parser.add_argument(
        "--importtime",
        type=int,
        default=0,
        metavar="N",
        help="also one -X importtime start per install; print its N slowest imports",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--serve-args", default="", help="more `plimsoll serve` arguments for every start, one string"
    )
    args = parser.parse_args()
    installs = dict(item.split("=", 1) for item in args.install)
    serve_args = ["--kv-cache-memory", "256MiB", "--max-model-len", "512"]
    if args.model:
        serve_args += ["--model", args.model]
    serve_args += args.serve_args.split()
    print(f"load average at the start: {os.getloadavg()[0]:.2f}", flush=True)
    if args.importtime:
        for label, python in installs.items():
            start = start_once(python, serve_args, True, args.timeout)
            print(f"\n{label}: -X importtime start (not counted), phases {start.phases}")
            for seconds, name in top_imports(start.log, args.importtime):
                print(f"  {seconds:7.3f} s  {name}")
    runs: dict[str, list[Start]] = {label: [] for label in installs}
    for r in range(args.repeats):
        for label, python in installs.items():
            start = start_once(python, serve_args, False, args.timeout)
            runs[label].append(start)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in start.phases.items())
            print(f"repeat {r + 1} {label:>8}: ready {start.ready_s:.2f} s, first byte {start.first_byte_s:.2f} s, "
                  f"cpu {start.cpu_s:.2f} s; "
                  f"phases (s from process start): {phases}", flush=True)  # fmt: skip
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    print(f"process spawn to first byte, {args.repeats} starts each (median, min-max):")
    medians = {}
    for label, starts in runs.items():
        fb = [s.first_byte_s for s in starts]
        rd = [s.ready_s for s in starts]
        imp = [s.phases.get("imports", float("nan")) for s in starts]
        cpu = [s.cpu_s for s in starts]
        medians[label] = statistics.median(fb)
        print(f"  {label:>8}: first byte {statistics.median(fb):.2f} s ({min(fb):.2f}-{max(fb):.2f}); "
              f"ready {statistics.median(rd):.2f} s ({min(rd):.2f}-{max(rd):.2f}); "
              f"imports phase {statistics.median(imp):.2f} s; server CPU to first byte "
              f"{statistics.median(cpu):.2f} s ({min(cpu):.2f}-{max(cpu):.2f})")  # fmt: skip
    labels = list(runs)
    if len(labels) > 1:
        base = medians[labels[-1]]
        for label in labels[:-1]:
            print(f"  {label} / {labels[-1]}: {medians[label] / base:.2f}x")
    answers = {(s.text, s.prompt_tokens) for starts in runs.values() for s in starts}
    print(
        f"answers (text, prompt tokens) across all starts: {sorted(answers)}; identical: {len(answers) == 1}"
    )


if __name__ == "__main__":
    main()
