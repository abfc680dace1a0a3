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
from typing import Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console

from plimsoll.bench.cli_flags import (
    API_KEY,
    CLIENT,
    GATES,
    LEVEL,
    MODEL_MIX,
    SERVER,
    SHAPE,
    SHARED_PREFIX,
    SLO_FLAGS,
    with_flags,
)
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

HEADROOM = typer.Option(0.75, "--headroom", help="Recommended concurrency = floor(headroom × min(knees))")
MIN_DURATION = typer.Option(
    None,
    "--min-duration-per-level",
    min=0.0,
    help="Floor under the request count: a level also runs at least this many measured seconds "
    "(more requests, same concurrency), so a fast server is not measured in one or two waves",
    show_default=False,
)


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
        _bad_input(exc)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors())
        err.print(f"error: invalid options: {msgs}", markup=False)
        raise typer.Exit(2) from exc


def _bad_input(exc: BenchInputError) -> NoReturn:
    """A flag's value is wrong: say why and exit 2 (as typer does for its own usage errors)."""
    err.print(f"error: {exc}", markup=False)
    raise typer.Exit(2) from exc


def _windowed_config(
    flags: dict[str, Any], concurrency: int, duration: str, window: float
) -> tuple[BenchConfig, float]:
    """Soak and spec-ab: ``concurrency`` clients for ``duration``, recorded per ``window`` with no warm-up."""
    try:
        seconds = parse_duration(duration)
    except BenchInputError as exc:
        _bad_input(exc)
    return make_config(flags, levels=(concurrency,), duration_per_level_s=window, warmup_requests=0), seconds


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


def execute_scenario(
    cfg: BenchConfig, output: Path | None, scenario: Callable[..., Awaitable[dict[str, Any]]], *args: Any
) -> None:
    """``execute`` one of ``scenarios``' runs: ``scenario(session, *args, on_start)``."""

    async def body(session: Any, live: Live) -> dict[str, Any]:
        return dict(await scenario(session, *args, live.start))

    execute(cfg, body, output)


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
@with_flags(SERVER, MODEL_MIX, SHAPE, SHARED_PREFIX, LEVEL, SLO_FLAGS, CLIENT, GATES)
def sweep(
    flags: dict[str, Any],
    levels: str = typer.Option("1,2,4,8,12,16,24,32,48,64", "--levels", help="Concurrency levels"),
    min_duration_per_level: float | None = MIN_DURATION,
    headroom: float = HEADROOM,
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
        _bad_input(exc)
    cfg = make_config(flags | locals(), levels=level_list)
    execute(cfg, _sweep_body("sweep"), flags["output"], report_configmap, kind="sweep")


@app.command("run")
@with_flags(SERVER, MODEL_MIX, SHAPE, SHARED_PREFIX, LEVEL, SLO_FLAGS, CLIENT, GATES)
def run(
    flags: dict[str, Any],
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Clients in flight"),
) -> None:
    """One closed-loop level at --concurrency."""
    cfg = make_config(flags, levels=(concurrency,))
    execute(cfg, _sweep_body("run"), flags["output"], kind="run")


@app.command("rate")
@with_flags(SERVER, MODEL_MIX, SHAPE, SLO_FLAGS, CLIENT)
def rate(
    flags: dict[str, Any],
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
    cfg = make_config(flags | locals())

    execute_scenario(
        cfg, flags["output"], rate_levels, rate_list, arrival, burstiness, warmup_s, max_concurrency
    )


@app.command("baseline")
@with_flags(SERVER, SHAPE, CLIENT)
def baseline(
    flags: dict[str, Any],
    requests: int = typer.Option(20, "--requests", help="Sequential requests"),
) -> None:
    """Single-request baseline with a TPOT-stability check (warns above 20% variation)."""
    from plimsoll.bench.scenarios import run_baseline

    cfg = make_config(flags, levels=(1,), requests_per_level=requests, warmup_requests=1)

    execute_scenario(cfg, flags["output"], run_baseline)


@app.command("burst")
@with_flags(SERVER, SHAPE, CLIENT)
def burst(
    flags: dict[str, Any],
    steady_rate: float = typer.Option(1.0, "--steady-rate", help="Background requests per second"),
    burst_requests: int = typer.Option(32, "--burst-requests", help="Requests sent at once in the burst"),
    before_s: float = typer.Option(10.0, "--before", help="Seconds of steady load before the burst"),
    after_s: float = typer.Option(30.0, "--after", help="Seconds of steady load after the burst"),
) -> None:
    """A burst on top of steady load; reports how long latency takes to recover."""
    from plimsoll.bench.scenarios import run_burst

    cfg = make_config(flags)

    execute_scenario(cfg, flags["output"], run_burst, steady_rate, burst_requests, before_s, after_s)


@app.command("soak")
@with_flags(SERVER, SHAPE, CLIENT, GATES)
def soak(
    flags: dict[str, Any],
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Clients in flight"),
    duration: str = typer.Option(
        "30m",
        "--duration",
        help="How long: seconds, or with a unit (45m, 1h). Slow leaks need the 30-60 minutes load tests "
        "are advised to soak for",
    ),
    window: float = typer.Option(60.0, "--window", help="Seconds per recorded window"),
) -> None:
    """Steady load for a long time: latency, KV, memory, fds and connections per window; rises flagged."""
    from plimsoll.bench.scenarios import Windows, run_soak

    cfg, seconds = _windowed_config(flags, concurrency, duration, window)

    execute_scenario(cfg, flags["output"], run_soak, Windows(concurrency, seconds, window))


@app.command("spec-ab")
@with_flags(SERVER, SHAPE, CLIENT, GATES)
def spec_ab(
    flags: dict[str, Any],
    speculative_url: str = typer.Option(
        ...,
        "--speculative-url",
        help="The same model served with --speculative-config (the candidate); --url is the baseline without",
    ),
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Clients in flight on each server"),
    duration: str = typer.Option(
        "30m", "--duration", help="Time on each server: seconds, or 30m, 1h (an A/B decides over ~30 minutes)"
    ),
    window: float = typer.Option(
        60.0, "--window", help="Seconds per window; the arms alternate window by window"
    ),
) -> None:
    """A/B a speculative-decoding config: gain, acceptance rate, keep if > 30% faster."""
    from plimsoll.bench.scenarios import Windows
    from plimsoll.bench.session import BenchSession
    from plimsoll.bench.spec_ab import run_spec_ab

    cfg, seconds = _windowed_config(flags, concurrency, duration, window)
    candidate_cfg = cfg.model_copy(update={"url": speculative_url.rstrip("/")})
    each = Windows(concurrency, seconds, window)

    async def body(session: Any, live: Live) -> dict[str, Any]:
        candidate = await BenchSession.open(candidate_cfg)
        try:
            return dict(await run_spec_ab(session, candidate, each, live.start))
        finally:
            await candidate.aclose()

    execute(cfg, body, flags["output"])


@app.command("disagg")
@with_flags(SHAPE, SHARED_PREFIX, LEVEL, SLO_FLAGS, CLIENT, GATES)
def disagg(
    flags: dict[str, Any],
    url: list[str] = typer.Option(
        ..., "--url", help="A replica started with --kv-transfer-config '{\"kv_role\": \"kv_both\"}' (repeat: "
        "the replicas at hand)"
    ),
    ratios: str = typer.Option("1:1", "--ratios", help="Split layouts to try, PREFILL:DECODE replicas, e.g. 1:1,1:2"),
    # SERVER's other flags; its --url is one replica, this command's several.
    model: str | None = SERVER[1].option,
    api_key: str | None = API_KEY,
    endpoint: str = SERVER[3].option,
    levels: str = typer.Option("1,2,4", "--levels", help="Concurrency levels PER REPLICA of each layout"),
) -> None:
    """Aggregated vs split prefill/decode on the same replicas: goodput per replica, KV transfer cost, verdict."""
    from plimsoll.bench.client import BenchError
    from plimsoll.bench.disagg import compare, summary_lines
    from plimsoll.disaggregation import parse_ratios

    try:
        level_list = parse_levels(levels)
        ratio_list = parse_ratios(ratios)
    except (BenchInputError, ValueError) as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    cfg = make_config(flags | locals(), url=url[0], levels=level_list)
    output = flags["output"]
    say = lambda line: err.print(line, markup=False, highlight=False)  # noqa: E731
    try:
        report = asyncio.run(compare(cfg, [u.rstrip("/") for u in url], ratio_list, level_list, say))
    except BenchInputError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from exc
    except BenchError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from exc
    for line in summary_lines(report):
        typer.echo(line)
    if output is not None:
        output.write_text(json.dumps(report, indent=2, default=str))
        err.print(f"wrote {output}", markup=False)


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
        _bad_input(exc)
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
            return await asyncio.gather(server, observe(dcgm_url.rstrip("/"), window, interval))
        if nvml:
            return await asyncio.gather(server, observe_nvml(window, interval))
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
