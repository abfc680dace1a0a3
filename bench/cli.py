"""`plimsoll bench ...` and `plimsoll diagnose`.

What it is: typer commands that validate flags into one :class:`BenchConfig`,
run a session with live progress (rich on a terminal, plain lines otherwise) and
write the report, CSV, per-request JSONL, PNG plots and HTML. Bad input or a
server that cannot be benchmarked exits non-zero with the reason; no report is
written then. What it is not: measurement logic (session.py, loadgen.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console

from plimsoll.bench.config import (
    SLO,
    BenchConfig,
    BenchInputError,
    LengthSpec,
    parse_duration,
    parse_levels,
    parse_models,
)
from plimsoll.bench.progress import Live, plan_line

app = typer.Typer(no_args_is_help=True, help="Load-test a server and find its saturation knees.")
err = Console(stderr=True, soft_wrap=True)  # one message, one line: never wrapped at 80 columns

URL = typer.Option(..., "--url", help="Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000")
MODEL = typer.Option(None, "--model", help="Model id to request (default: the server's only model)")
MODELS = typer.Option(
    None,
    "--models",
    help="Comma-separated model ids sent in an even mix (a base model and its LoRA adapters); "
    "the report adds per-model figures to each level",
)
API_KEY = typer.Option(
    None, "--api-key", envvar="PLIMSOLL_API_KEY", help="Bearer token, if the server needs one"
)
ENDPOINT = typer.Option("completions", "--endpoint", help="completions or chat")
INPUT = typer.Option("128", "--input-tokens", help="N, uniform:LO:HI, normal:MEAN:STD or choice:A,B")
OUTPUT_TOKENS = typer.Option("64", "--output-tokens", help="N, uniform:LO:HI, normal:MEAN:STD or choice:A,B")
PREFIX = typer.Option(0, "--shared-prefix-tokens", help="Length of a prefix shared by a fraction of requests")
PREFIX_FRACTION = typer.Option(
    0.0, "--shared-prefix-fraction", help="Fraction of requests using the shared prefix"
)
REQUESTS = typer.Option(
    None,
    "--requests-per-level",
    help="Measured requests per level, at least one per client (default: max(100, 4 × concurrency); "
    "with --duration-per-level, as many as fit)",
    show_default=False,
)
DURATION = typer.Option(None, "--duration-per-level", help="Measured seconds per level (after warm-up)")
MIN_DURATION = typer.Option(
    None,
    "--min-duration-per-level",
    min=0.0,
    help="Floor under the request count: a level also runs at least this many measured seconds "
    "(more requests, same concurrency), so a fast server is not measured in one or two waves",
    show_default=False,
)
WARMUP = typer.Option(
    None, "--warmup-requests", help="Completions excluded as warm-up (default: one per client)"
)
REPEATS = typer.Option(1, "--repeats", help="Repeats per level")
SLO_TTFT = typer.Option(None, "--slo-ttft-p95-ms", help="SLO: TTFT p95 in ms")
SLO_TPOT = typer.Option(None, "--slo-tpot-p50-ms", help="SLO: TPOT p50 in ms")
SLO_E2E = typer.Option(None, "--slo-e2e-p95-ms", help="SLO: end-to-end p95 in ms")
HEADROOM = typer.Option(0.75, "--headroom", help="Recommended concurrency = floor(headroom × min(knees))")
TIMEOUT = typer.Option(120.0, "--request-timeout", help="Seconds before a request counts as timed out")
IGNORE_EOS = typer.Option(
    True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly max_tokens (vLLM extension)"
)
OUTPUT = typer.Option(
    None, "--output", "-o", help="JSON report path; CSV, JSONL, PNG and HTML are written beside it"
)
SEED = typer.Option(0, "--seed", help="Workload seed")
MAX_ERRORS = typer.Option(0.01, "--max-error-rate", help="Gate: a level with more errors is invalid")
MIN_CONC = typer.Option(
    0.95, "--min-concurrency-ratio", help="Gate: achieved/target concurrency below is invalid"
)
MAX_LAG = typer.Option(50.0, "--max-client-lag-ms", help="Gate: client event-loop lag p99 above is invalid")


# Flag names that differ from the BenchConfig field they fill.
_FLAG_TO_FIELD = {
    "duration_per_level": "duration_per_level_s",
    "min_duration_per_level": "min_duration_per_level_s",
    "request_timeout": "request_timeout_s",
}
_SLO_FLAGS = {
    "slo_ttft_p95_ms": "ttft_p95_ms",
    "slo_tpot_p50_ms": "tpot_p50_ms",
    "slo_e2e_p95_ms": "e2e_p95_ms",
}


def make_config(flags: dict[str, Any], **fields: Any) -> BenchConfig:
    """Validate a command's flags (its ``locals()``) into the config; bad values exit 2 with the reason.

    Flags that name a config field (directly, through ``_FLAG_TO_FIELD`` or as an SLO)
    fill it; the command's own flags (``--levels``, ``--rate``, ``--output`` ...) are
    left out, and ``fields`` sets or overrides fields the command derives itself.
    """
    kw = {_FLAG_TO_FIELD.get(k, k): v for k, v in flags.items() if k not in _SLO_FLAGS}
    kw = {k: v for k, v in kw.items() if k in BenchConfig.model_fields} | fields
    try:
        kw["models"] = parse_models(kw.get("models"))
        kw["input_tokens"] = LengthSpec.parse(kw["input_tokens"])
        kw["output_tokens"] = LengthSpec.parse(kw["output_tokens"])
        kw["slo"] = SLO(**{field: flags.get(flag) for flag, field in _SLO_FLAGS.items()})
        return BenchConfig(**kw)
    except BenchInputError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors())
        err.print(f"error: invalid options: {msgs}", markup=False)
        raise typer.Exit(2) from exc


def execute(
    cfg: BenchConfig,
    body: Callable[[Any, Live], Awaitable[dict[str, Any]]],
    output: Path | None,
    report_configmap: str | None = None,
    kind: str = "scenario",
) -> None:
    """Open a session, run ``body``, print the summary and write outputs; map failures to exit codes."""
    from plimsoll.bench.client import BenchError
    from plimsoll.bench.report import print_summary, write_outputs
    from plimsoll.bench.session import BenchSession

    partial: dict[str, Any] = {}

    async def main() -> tuple[dict[str, Any], list[Any]]:
        session = await BenchSession.open(cfg)
        # Ctrl-C: asyncio.run cancels this task and raises KeyboardInterrupt (a second Ctrl-C raises
        # it at once); either way the finished levels of this session are written as partial.
        partial.update(session=session)
        try:
            live = Live(cfg, err)
            if kind in ("sweep", "run"):
                err.print(plan_line(cfg, kind), markup=False, highlight=False)
            with live.running():
                report = await body(session, live)
            return report, session.runs
        finally:
            await session.aclose()

    try:
        report, runs = asyncio.run(main())
    except BenchError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt as exc:
        _write_partial(partial.get("session"), kind, output)
        raise typer.Exit(130) from exc
    # On a terminal the table wraps to its width; off one (logs, CI) rich assumes 80 columns.
    print_summary(report, Console(width=None if sys.stdout.isatty() else 120, soft_wrap=False))
    if output is not None:
        from plimsoll.bench.plots import write_plots

        paths = write_outputs(report, output, runs)
        paths += write_plots(report, output)
        err.print("wrote " + ", ".join(str(p) for p in paths), markup=False)
    if report_configmap is not None:
        from plimsoll.bench.publish import PublishError, parse_configmap_ref, publish_report

        try:
            ref = parse_configmap_ref(report_configmap)
            asyncio.run(publish_report(report, ref))
        except PublishError as exc:
            err.print(f"error: {exc}", markup=False)
            raise typer.Exit(1) from exc
        err.print(f"published the JSON report to ConfigMap {ref} (key report.json)", markup=False)


def _sweep_body(kind: str) -> Callable[[Any, Live], Awaitable[dict[str, Any]]]:
    async def body(session: Any, live: Live) -> dict[str, Any]:
        from plimsoll.bench.report import validate
        from plimsoll.bench.verify import apply_verification, verify

        levels = await session.sweep(live.start, live.level)
        report = dict(session.report(kind, levels))
        if kind == "sweep" and session.cfg.verify_seconds > 0:
            rec = report["recommendation"]["concurrency_per_replica"]
            if rec is not None:
                err.print(
                    f"verifying: holding c={rec} for {session.cfg.verify_seconds:g} s (stepping down if it misses)",
                    markup=False,
                    highlight=False,
                )
            verification = await verify(
                session, report, lambda line: err.print(line, markup=False, highlight=False)
            )
            if verification is not None:
                report = apply_verification(report, verification)
                validate(report)
        return report

    return body


def _write_partial(session: Any, kind: str, output: Path | None) -> None:
    """After Ctrl-C: keep the finished levels as a report marked partial, and say where it went."""
    import datetime as dt

    from plimsoll.bench.client import BenchError
    from plimsoll.bench.report import write_outputs

    done = list(session.finished_levels) if session is not None else []
    planned = len(session.cfg.levels) if session is not None else 0
    if kind not in ("sweep", "run") or not done:
        err.print("interrupted before any level finished; no report written", markup=False)
        return
    try:
        report = session.report(kind, done, partial=True)
    except BenchError as exc:
        err.print(f"interrupted; no partial report: {exc}", markup=False)
        return
    if output is None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        output = Path(f"plimsoll-bench-{kind}-partial-{stamp}.json")
    write_outputs(
        report, output, [r for r in session.runs if r.concurrency in {lv["concurrency"] for lv in done}]
    )
    err.print(
        f"interrupted after {len(done)} of {planned} levels: wrote partial report {output} "
        '(marked "partial": true; rerun the missing levels with --levels)',
        markup=False,
        highlight=False,
    )


@app.command("sweep")
def sweep(
    url: str = URL,
    model: str | None = MODEL,
    models: str | None = MODELS,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    shared_prefix_tokens: int = PREFIX,
    shared_prefix_fraction: float = PREFIX_FRACTION,
    levels: str = typer.Option("1,2,4,8,12,16,24,32,48,64", "--levels", help="Concurrency levels"),
    requests_per_level: int | None = REQUESTS,
    duration_per_level: float | None = DURATION,
    min_duration_per_level: float | None = MIN_DURATION,
    warmup_requests: int | None = WARMUP,
    repeats: int = REPEATS,
    slo_ttft_p95_ms: float | None = SLO_TTFT,
    slo_tpot_p50_ms: float | None = SLO_TPOT,
    slo_e2e_p95_ms: float | None = SLO_E2E,
    headroom: float = HEADROOM,
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_error_rate: float = MAX_ERRORS,
    min_concurrency_ratio: float = MIN_CONC,
    max_client_lag_ms: float = MAX_LAG,
    disturbed_client_lag_ms: float = typer.Option(
        20.0,
        "--disturbed-client-lag-ms",
        help="Mark a level disturbed (host busy) when the client's event-loop lag p99 is above this",
    ),
    verify_seconds: float = typer.Option(
        0.0,
        "--verify-seconds",
        min=0.0,
        help="After the sweep, hold the recommended concurrency this long; below 99% SLO attainment or "
        "with a growing queue step down and hold again (0: no hold)",
    ),
    output: Path | None = OUTPUT,
    report_configmap: str | None = typer.Option(
        None,
        "--report-configmap",
        help="Also write the JSON report into this ConfigMap (NAMESPACE/NAME, key report.json), "
        "as a profiling Job does for the operator",
    ),
) -> None:
    """Closed-loop concurrency sweep: knees and the per-replica recommendation."""
    try:
        level_list = parse_levels(levels)
        if report_configmap is not None:
            from plimsoll.bench.publish import PublishError, parse_configmap_ref

            try:
                parse_configmap_ref(report_configmap)  # fail before the sweep, not after it
            except PublishError as exc:
                raise BenchInputError(str(exc)) from exc
    except BenchInputError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    cfg = make_config(locals(), levels=level_list)
    execute(cfg, _sweep_body("sweep"), output, report_configmap, kind="sweep")


@app.command("run")
def run(
    url: str = URL,
    model: str | None = MODEL,
    models: str | None = MODELS,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Clients in flight"),
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    shared_prefix_tokens: int = PREFIX,
    shared_prefix_fraction: float = PREFIX_FRACTION,
    requests_per_level: int | None = REQUESTS,
    duration_per_level: float | None = DURATION,
    warmup_requests: int | None = WARMUP,
    repeats: int = REPEATS,
    slo_ttft_p95_ms: float | None = SLO_TTFT,
    slo_tpot_p50_ms: float | None = SLO_TPOT,
    slo_e2e_p95_ms: float | None = SLO_E2E,
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_error_rate: float = MAX_ERRORS,
    min_concurrency_ratio: float = MIN_CONC,
    max_client_lag_ms: float = MAX_LAG,
    output: Path | None = OUTPUT,
) -> None:
    """One closed-loop level at --concurrency."""
    cfg = make_config(locals(), levels=(concurrency,))
    execute(cfg, _sweep_body("run"), output, kind="run")


@app.command("rate")
def rate(
    url: str = URL,
    model: str | None = MODEL,
    models: str | None = MODELS,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    rates: str = typer.Option("1", "--rate", help="Requests per second; comma-separated for several levels"),
    arrival: str = typer.Option("poisson", "--arrival", help="constant, poisson or bursty"),
    burstiness: float = typer.Option(
        0.5, "--burstiness", help="Gamma shape for bursty arrivals (<1 is burstier)"
    ),
    duration_per_level: float = typer.Option(30.0, "--duration-per-level", help="Seconds per rate"),
    warmup_s: float = typer.Option(
        2.0, "--warmup-seconds", help="Seconds excluded at the start of each rate"
    ),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", help="Cap on requests in flight"),
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    slo_ttft_p95_ms: float | None = SLO_TTFT,
    slo_tpot_p50_ms: float | None = SLO_TPOT,
    slo_e2e_p95_ms: float | None = SLO_E2E,
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_client_lag_ms: float = MAX_LAG,
    output: Path | None = OUTPUT,
) -> None:
    """Open-loop arrivals (constant, Poisson or bursty) at one or more rates."""
    from plimsoll.bench.scenarios import rate_levels

    if arrival not in ("constant", "poisson", "bursty"):
        err.print(f"error: --arrival must be constant, poisson or bursty, not {arrival!r}", markup=False)
        raise typer.Exit(2)
    try:
        rate_list = [float(r) for r in rates.split(",")]
        assert rate_list and min(rate_list) > 0
    except (ValueError, AssertionError) as exc:
        err.print(f"error: --rate must be positive numbers like 2 or 1,2,4; got {rates!r}", markup=False)
        raise typer.Exit(2) from exc
    cfg = make_config(locals())

    async def body(session: Any, live: Live) -> dict[str, Any]:
        levels = await rate_levels(
            session, rate_list, arrival, burstiness, warmup_s, max_concurrency, live.start
        )
        return dict(levels)

    execute(cfg, body, output)


@app.command("baseline")
def baseline(
    url: str = URL,
    model: str | None = MODEL,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    requests: int = typer.Option(20, "--requests", help="Sequential requests"),
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_client_lag_ms: float = MAX_LAG,
    output: Path | None = OUTPUT,
) -> None:
    """Single-request baseline with a TPOT-stability check (warns above 20% variation)."""
    from plimsoll.bench.scenarios import run_baseline

    cfg = make_config(locals(), levels=(1,), requests_per_level=requests, warmup_requests=1)

    async def body(session: Any, live: Live) -> dict[str, Any]:
        return dict(await run_baseline(session, live.start))

    execute(cfg, body, output)


@app.command("burst")
def burst(
    url: str = URL,
    model: str | None = MODEL,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    steady_rate: float = typer.Option(1.0, "--steady-rate", help="Background requests per second"),
    burst_requests: int = typer.Option(32, "--burst-requests", help="Requests sent at once in the burst"),
    before_s: float = typer.Option(10.0, "--before", help="Seconds of steady load before the burst"),
    after_s: float = typer.Option(30.0, "--after", help="Seconds of steady load after the burst"),
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_client_lag_ms: float = MAX_LAG,
    output: Path | None = OUTPUT,
) -> None:
    """A burst on top of steady load; reports how long latency takes to recover."""
    from plimsoll.bench.scenarios import run_burst

    cfg = make_config(locals())

    async def body(session: Any, live: Live) -> dict[str, Any]:
        return dict(await run_burst(session, steady_rate, burst_requests, before_s, after_s, live.start))

    execute(cfg, body, output)


@app.command("soak")
def soak(
    url: str = URL,
    model: str | None = MODEL,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Clients in flight"),
    duration: str = typer.Option(
        "30m",
        "--duration",
        help="How long: seconds, or with a unit (45m, 1h). Slow leaks need the 30-60 minutes load tests "
        "are advised to soak for",
    ),
    window: float = typer.Option(60.0, "--window", help="Seconds per recorded window"),
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_client_lag_ms: float = MAX_LAG,
    max_error_rate: float = MAX_ERRORS,
    min_concurrency_ratio: float = MIN_CONC,
    output: Path | None = OUTPUT,
) -> None:
    """Steady load for a long time: latency, KV, memory, fds and connections per window; rises flagged."""
    from plimsoll.bench.scenarios import run_soak

    try:
        seconds = parse_duration(duration)
    except BenchInputError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    cfg = make_config(locals(), levels=(concurrency,), duration_per_level_s=window, warmup_requests=0)

    async def body(session: Any, live: Live) -> dict[str, Any]:
        return dict(await run_soak(session, concurrency, seconds, window, live.start))

    execute(cfg, body, output)


@app.command("spec-ab")
def spec_ab(
    url: str = URL,
    speculative_url: str = typer.Option(
        ...,
        "--speculative-url",
        help="The same model served with --speculative-config (the candidate); --url is the baseline without",
    ),
    model: str | None = MODEL,
    api_key: str | None = API_KEY,
    endpoint: str = ENDPOINT,
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Clients in flight on each server"),
    duration: str = typer.Option(
        "30m", "--duration", help="Time on each server: seconds, or 30m, 1h (an A/B decides over ~30 minutes)"
    ),
    window: float = typer.Option(
        60.0, "--window", help="Seconds per window; the arms alternate window by window"
    ),
    input_tokens: str = INPUT,
    output_tokens: str = OUTPUT_TOKENS,
    request_timeout: float = TIMEOUT,
    ignore_eos: bool = IGNORE_EOS,
    seed: int = SEED,
    max_client_lag_ms: float = MAX_LAG,
    max_error_rate: float = MAX_ERRORS,
    min_concurrency_ratio: float = MIN_CONC,
    output: Path | None = OUTPUT,
) -> None:
    """A/B a speculative-decoding config: gain, acceptance rate, keep if > 30% faster."""
    from plimsoll.bench.session import BenchSession
    from plimsoll.bench.spec_ab import run_spec_ab

    try:
        seconds = parse_duration(duration)
    except BenchInputError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    cfg = make_config(locals(), levels=(concurrency,), duration_per_level_s=window, warmup_requests=0)
    candidate_cfg = cfg.model_copy(update={"url": speculative_url.rstrip("/")})

    async def body(session: Any, live: Live) -> dict[str, Any]:
        candidate = await BenchSession.open(candidate_cfg)
        try:
            return dict(await run_spec_ab(session, candidate, concurrency, seconds, window, live.start))
        finally:
            await candidate.aclose()

    execute(cfg, body, output)


@app.command("simulate")
def simulate(
    port: int = typer.Option(8000, "--port"),
    batch_cap: int = typer.Option(16, "--batch-cap", help="Requests decoded at once; more wait in a queue"),
    step_ms: float = typer.Option(20.0, "--step-ms", help="Step time at batch 0 (t0)"),
    step_per_seq_ms: float = typer.Option(
        0.5, "--step-per-seq-ms", help="Added step time per running request (k)"
    ),
    degrade_above: int = typer.Option(
        0, "--degrade-above", min=0, help="Above this many running requests steps slow down (0: never)"
    ),
    degrade_factor: float = typer.Option(
        1.0, "--degrade-factor", min=1.0, help="How many times slower a step is above --degrade-above"
    ),
    prefill_ms_per_token: float = typer.Option(0.0, "--prefill-ms-per-token"),
    model: str = typer.Option("sim-model", "--model"),
    host: str = typer.Option("127.0.0.1", "--host"),
    enable_lora: bool = typer.Option(False, "--enable-lora", help="Serve vLLM's LoRA adapter API"),
    lora_modules: list[str] = typer.Option(
        [],
        "--lora-modules",
        help="An adapter as name=path (a directory with adapter_config.json); repeatable",
    ),
    max_loras: int = typer.Option(4, "--max-loras", min=1, help="The lora_requests_info max_lora label"),
) -> None:
    """Serve a simulated OpenAI-compatible model with a known service curve (no GPU needed)."""
    from plimsoll.bench.simulator import ServiceCurve, serve

    try:
        curve = ServiceCurve(
            batch_cap=batch_cap,
            step_t0_s=step_ms / 1e3,
            step_k_s=step_per_seq_ms / 1e3,
            prefill_s_per_token=prefill_ms_per_token / 1e3,
            model=model,
            enable_lora=enable_lora or bool(lora_modules),
            lora_modules=tuple(lora_modules),
            max_loras=max_loras,
            degrade_above=degrade_above,
            degrade_factor=degrade_factor,
        )
    except ValueError as error:  # a bad name=path or adapter directory
        raise typer.BadParameter(str(error)) from error
    err.print(
        f"simulating {model} on http://{host}:{port}: batch cap {batch_cap}, "
        f"t(b) = {step_ms:g} + {step_per_seq_ms:g}·b ms",
        markup=False,
    )
    serve(curve, host=host, port=port)


def diagnose(
    url: str = typer.Option(..., "--url", help="Base URL of the server whose /metrics to read"),
    window: float = typer.Option(30.0, "--window", min=0.1, help="Seconds to watch"),
    interval: float = typer.Option(1.0, "--interval", min=0.05, help="Seconds between scrapes"),
    api_key: str | None = API_KEY,
    slo_ttft_p95_ms: float | None = typer.Option(
        None, "--slo-ttft-p95-ms", help="SLO: TTFT above it is slow"
    ),
    slo_tpot_p50_ms: float | None = typer.Option(
        None, "--slo-tpot-p50-ms", help="SLO: TPOT above it is slow"
    ),
    baseline: Path | None = typer.Option(
        None,
        "--baseline",
        help="A `plimsoll bench baseline` (or sweep) report of this server: decode is slow at "
        "2× its c=1 TPOT",
    ),
    dcgm_url: str | None = typer.Option(
        None,
        "--dcgm-url",
        help="Base URL of the NVIDIA DCGM-exporter on the replica's node (e.g. http://NODE:9400): GPU "
        "utilisation, memory, temperature, power and clocks join the verdict",
    ),
    dcgm_pod: str | None = typer.Option(
        None, "--dcgm-pod", help="Only the GPUs the exporter maps to this pod (its `pod` label)"
    ),
    gpu: str | None = typer.Option(None, "--gpu", help="Only these GPU indices, e.g. 0,1 (the `gpu` label)"),
    nvml: bool = typer.Option(
        False,
        "--nvml",
        help="Read this host's GPUs through NVML instead of an exporter (run on the replica's host or pod; "
        "needs nvidia-ml-py)",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON"),
) -> None:
    """Read a server's /metrics over a window and name the layer that limits it."""
    import httpx

    from plimsoll.bench.diagnose import Thresholds, analyse, observe, observe_nvml, render

    th = Thresholds()
    try:
        th = _decode_limit(th, slo_tpot_p50_ms, baseline)
    except BenchInputError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    if slo_ttft_p95_ms is not None:
        th = dataclasses.replace(th, ttft_high_s=slo_ttft_p95_ms / 1e3)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    err.print(
        f"watching {url.rstrip('/')}/metrics for {window:g} s (a scrape every {interval:g} s); "
        "put load on the server meanwhile",
        markup=False,
        highlight=False,
    )
    if dcgm_url and nvml:
        err.print("error: pass --dcgm-url or --nvml, not both", markup=False)
        raise typer.Exit(2)
    gpus = tuple(g.strip() for g in (gpu or "").split(",") if g.strip())
    bar = _window_progress(window)

    async def watch() -> tuple[list[Any], list[Any] | None]:
        server = observe(url.rstrip("/"), window, interval, headers, bar)
        if dcgm_url:
            return await asyncio.gather(server, observe(dcgm_url.rstrip("/"), window, interval))  # type: ignore[return-value]
        if nvml:
            return await asyncio.gather(server, observe_nvml(window, interval))  # type: ignore[return-value]
        return await server, None

    try:
        samples, gpu_samples = asyncio.run(watch())
    except (httpx.HTTPError, ValueError) as exc:
        where = f"{dcgm_url}/metrics or {url}/metrics" if dcgm_url else f"{url}/metrics"
        err.print(
            f"error: cannot read {where} ({type(exc).__name__}: {exc}); check --url (and --dcgm-url) and that "
            "they expose Prometheus metrics",
            markup=False,
        )
        raise typer.Exit(1) from exc
    finally:
        if bar is not None:
            bar(-1.0)  # stop the bar
    if nvml and not gpu_samples:
        err.print(
            "error: --nvml found no NVML or no GPU here (pip install nvidia-ml-py on a GPU host)",
            markup=False,
        )
        raise typer.Exit(2)
    result = analyse(samples, th, gpu_samples, (dcgm_pod, gpus))
    if as_json:
        typer.echo(json.dumps(result.as_dict(), indent=2))
    else:
        for line in render(result):
            typer.echo(line)
        if th.tpot_limit_s is None and result.engine_family is not None:
            typer.echo(
                "note: decode speed not judged (only its spread): give --slo-tpot-p50-ms, or --baseline "
                "with a `plimsoll bench baseline` report of this server"
            )
    if result.engine_family is None:
        raise typer.Exit(1)


def _decode_limit(th: Any, slo_tpot_p50_ms: float | None, baseline: Path | None) -> Any:
    """The TPOT above which decode counts as slow: the SLO, else 2× the server's own c=1 TPOT."""
    if slo_tpot_p50_ms is not None:
        return dataclasses.replace(
            th,
            tpot_limit_s=slo_tpot_p50_ms / 1e3,
            tpot_limit_why=f"the SLO --slo-tpot-p50-ms {slo_tpot_p50_ms:g}",
        )
    if baseline is None:
        return th
    try:
        report = json.loads(baseline.read_text())
        c1 = next(lv for lv in report["levels"] if lv.get("concurrency") == 1 and lv["latency_ms"]["tpot"])
        tpot_c1 = c1["latency_ms"]["tpot"]["p50"] / 1e3
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as exc:
        raise BenchInputError(
            f"--baseline {baseline}: no c=1 level with TPOT in it ({type(exc).__name__}); "
            "write one with `plimsoll bench baseline --url URL -o baseline.json`"
        ) from exc
    limit = th.tpot_inflation * tpot_c1
    why = f"{th.tpot_inflation:g}× this server's c=1 TPOT p50 of {tpot_c1 * 1e3:.0f} ms in {baseline.name}"
    return dataclasses.replace(th, tpot_limit_s=limit, tpot_limit_why=why)


def _window_progress(window: float) -> Callable[[float], None] | None:
    """A rich bar over the watch window on a terminal; nothing in logs (the start line said how long)."""
    if not err.is_terminal:
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("watching /metrics"), BarColumn(), TimeRemainingColumn(), console=err)
    task = progress.add_task("watch", total=window)
    progress.start()

    def update(elapsed: float) -> None:
        if elapsed < 0:
            progress.stop()
        else:
            progress.update(task, completed=min(elapsed, window))

    return update
