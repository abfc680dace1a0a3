"""Cold start against wake from sleep on a real `plimsoll serve`, side by side in one run.

What it measures, ``--rounds`` times on the embedded model (or ``--model``):

* cold start: the process is spawned → ``/ready`` answers 200 → the first byte of a
  streamed completion (what a replica started from zero costs a waiting request);
* wake from sleep level 1 and level 2: ``POST /sleep?level=N`` (timed too) on the
  warm server, then ``POST /wake_up`` → the first byte of the same streamed
  completion (what ``autoscaling.standby`` costs a request instead of a cold start).

It checks that the greedy answer after each wake equals the one before sleeping and
reads the server's resident memory awake and asleep (and its own count of resident KV
bytes, ``plimsoll_kv_cache_resident_bytes``). Each cold start's phases are read from
``plimsoll_startup_phase_seconds``, and the first byte of the same request on the warm,
awake server is measured too (what any request costs on this host: the floor a wake can
reach). With ``--compilation-cache-dir`` the first start fills the cache (packed CPU
panels; compile caches on CUDA) and later starts map it, as on a node whose volume holds
it. It prints medians and the cold start ÷ wake ratios. The CPU is shared, so compare
the ratios, not the absolute seconds, with another machine. A script that prints
figures, not a test.

    python benchmarks/scaleup_wake.py --rounds 3 [--compilation-cache-dir DIR]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from plimsoll.runtime.testing import ServerProcess

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def first_byte(url: str) -> tuple[float, str]:
    """Seconds to the first streamed byte of the completion, and the whole greedy answer."""
    t0 = time.perf_counter()
    text, first = [], None
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=300
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line:
                first = time.perf_counter() - t0
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text.append(choices[0].get("text") or "")
    assert first is not None, "no byte came back"
    return first, "".join(text)


def rss(server: ServerProcess) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def scrape(url: str, name: str) -> dict[str, float]:
    """``name``'s series from ``/metrics``: the label set's text (or ``""``) -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name) :]] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument(
        "--compilation-cache-dir", default=None, help="pass it to the server: the first start fills it, later ones map it"
    )
    args = parser.parse_args()
    serve_args = ["--enable-sleep-mode", "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "512"]
    if args.model:
        serve_args += ["--model", args.model]
    if args.compilation_cache_dir:
        serve_args += ["--compilation-cache-dir", args.compilation_cache_dir]
    warm: list[float] = []
    kv_asleep: dict[int, list[float]] = {1: [], 2: []}
    cold: list[float] = []
    ready: list[float] = []
    wake: dict[int, list[float]] = {1: [], 2: []}
    sleep: dict[int, list[float]] = {1: [], 2: []}
    freed: dict[int, list[float]] = {1: [], 2: []}
    same = True
    for r in range(args.rounds):
        server = ServerProcess(serve_args, startup_timeout=600)
        t0 = time.perf_counter()
        server.start()
        ready.append(time.perf_counter() - t0)
        ttfb, reference = first_byte(server.url)
        cold.append(ready[-1] + ttfb)
        try:
            phases = {k.split('phase="')[1].split('"')[0]: v for k, v in scrape(server.url, "plimsoll_startup_phase_seconds").items()}
            warm.append(first_byte(server.url)[0])
            for level in (1, 2):
                awake = rss(server)
                t = time.perf_counter()
                slept = httpx.post(f"{server.url}/sleep", params={"level": level}, timeout=300)
                slept.raise_for_status()
                sleep[level].append(time.perf_counter() - t)
                freed[level].append(awake - rss(server))
                kv_asleep[level].append(sum(scrape(server.url, "plimsoll_kv_cache_resident_bytes").values()))
                t = time.perf_counter()
                httpx.post(f"{server.url}/wake_up", timeout=300).raise_for_status()
                woke = time.perf_counter() - t
                ttfb, text = first_byte(server.url)
                wake[level].append(woke + ttfb)
                same = same and text == reference
        finally:
            server.stop()
        print(f"repeat {r + 1}: cold start to first byte {cold[-1]:.2f} s (Ready {ready[-1]:.2f} s); "
              f"wake to first byte: level 1 {wake[1][-1]:.3f} s, level 2 {wake[2][-1]:.3f} s; "
              f"awake first byte {warm[-1]:.3f} s", flush=True)  # fmt: skip
        print("  start-up phases (s from process start): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print(f"\nmedians over {args.rounds} rounds:")
    print(f"  cold start (spawn → Ready → first byte): {med(cold):.2f} s (Ready after {med(ready):.2f} s)")
    print(f"  awake, warm server → first byte: {med(warm):.3f} s")
    for level in (1, 2):
        print(f"  sleep level {level}: sleep {med(sleep[level]):.3f} s, frees {med(freed[level]) / 2**20:.0f} MiB "
              f"resident (KV resident asleep {med(kv_asleep[level]) / 2**20:.1f} MiB); wake → first byte "
              f"{med(wake[level]):.3f} s = {med(wake[level]) / med(cold):.3f} of cold start "
              f"(cold start ÷ wake = {med(cold) / med(wake[level]):.1f}×), {med(wake[level]) / med(warm):.2f}× an awake first byte")  # fmt: skip
    print(f"  greedy output after every wake identical to before sleeping: {same}")


if __name__ == "__main__":
    main()
