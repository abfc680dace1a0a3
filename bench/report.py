"""The versioned JSON report (the operator's contract), CSV, per-request JSONL and the table.

What it is: assembling the report dict, validating it against
``report.schema.json`` (shipped in the package), and writing it with its
companions next to ``--output``. What it is not: measuring or plotting.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
from rich.console import Console
from rich.table import Table

from plimsoll import __version__
from plimsoll.bench.config import BenchConfig
from plimsoll.bench.knees import LatencyKnee, Recommendation, ThroughputKnee, as_dict
from plimsoll.bench.loadgen import LevelRun

SCHEMA_VERSION = "1.0"


@cache
def schema() -> dict[str, Any]:
    text = resources.files("plimsoll.bench").joinpath("report.schema.json").read_text()
    return dict(json.loads(text))


def validate(report: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when the report breaks its contract."""
    jsonschema.validate(report, schema())


def build_report(
    kind: str,
    cfg: BenchConfig,
    server: dict[str, Any],
    workload: dict[str, Any],
    levels: list[dict[str, Any]],
    thr: ThroughputKnee,
    lat: LatencyKnee,
    rec: Recommendation,
    warnings: list[str],
    scenario: dict[str, Any] | None = None,
    confidence: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The report dict, validated; ``confidence`` is by knee name (and "recommendation")."""
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tool": {"name": "plimsoll-bench", "version": __version__},
        "server": server,
        "workload": {
            **workload,
            "levels": list(cfg.levels),
            "requests_per_level": cfg.requests_per_level,
            "duration_per_level_s": cfg.duration_per_level_s,
            "min_duration_per_level_s": cfg.min_duration_per_level_s,
            "warmup_requests": cfg.warmup_requests,
            "repeats": cfg.repeats,
        },
        "slo": cfg.slo.model_dump(),
        "levels": levels,
        "knees": {"throughput": as_dict(thr), "latency": as_dict(lat)},
        "recommendation": as_dict(rec),
        "warnings": warnings,
    }
    if scenario is not None:
        report["scenario"] = scenario
    for name, note in (confidence or {}).items():
        target = report["recommendation"] if name == "recommendation" else report["knees"][name]
        target["confidence"] = note
    disturbed = [lv["concurrency"] for lv in levels if (lv.get("disturbed") or {}).get("reasons")]
    report["disturbed_levels"] = disturbed
    validate(report)
    return report


CSV_FIELDS = (
    "concurrency",
    "rate",
    "valid",
    "achieved_concurrency",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "goodput_requests_per_s",
    "slo_attainment",
    "error_rate",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p95_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p95_ms",
    "e2e_p99_ms",
    "server_running_mean",
    "server_waiting_mean",
    "server_kv_usage_max",
    "server_preemptions",
)


def level_row(lv: dict[str, Any]) -> dict[str, Any]:
    lat = lv["latency_ms"]
    srv = lv.get("server") or {}

    def pct(metric: str, p: str) -> float | None:
        return None if lat.get(metric) is None else lat[metric][p]

    def gauge(name: str, stat: str) -> float | None:
        return None if not srv.get(name) else srv[name][stat]

    return {
        "concurrency": lv["concurrency"],
        "rate": lv["rate"],
        "valid": lv["valid"],
        "achieved_concurrency": lv["achieved_concurrency"],
        **{
            k: lv["throughput"].get(k)
            for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "goodput_requests_per_s")
        },
        "slo_attainment": lv.get("slo_attainment"),
        "error_rate": lv["requests"]["error_rate"],
        "ttft_p50_ms": pct("ttft", "p50"),
        "ttft_p95_ms": pct("ttft", "p95"),
        "ttft_p99_ms": pct("ttft", "p99"),
        "tpot_p50_ms": pct("tpot", "p50"),
        "tpot_p95_ms": pct("tpot", "p95"),
        "itl_p99_ms": pct("itl", "p99"),
        "e2e_p50_ms": pct("e2e", "p50"),
        "e2e_p95_ms": pct("e2e", "p95"),
        "e2e_p99_ms": pct("e2e", "p99"),
        "server_running_mean": gauge("running", "mean"),
        "server_waiting_mean": gauge("waiting", "mean"),
        "server_kv_usage_max": gauge("kv_usage", "max"),
        "server_preemptions": srv.get("preemptions"),
    }


def write_outputs(report: dict[str, Any], output: Path, runs: list[LevelRun]) -> list[Path]:
    """Write ``output`` (JSON) plus ``.csv`` and ``.requests.jsonl`` beside it; return the paths."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    stem = output.with_suffix("")
    csv_path, jsonl_path = Path(f"{stem}.csv"), Path(f"{stem}.requests.jsonl")
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for lv in report["levels"]:
            writer.writerow(level_row(lv))
    with jsonl_path.open("w") as fh:
        for run in runs:
            for rec in run.records:
                row = {
                    "concurrency": run.concurrency,
                    "rate": run.rate,
                    "repeat": run.repeat,
                    **rec.as_json(run.origin),
                }
                fh.write(json.dumps(row) + "\n")
    return [output, csv_path, jsonl_path]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# What fits on an 80-column screen; every other figure is in the CSV and JSON (see CSV_FIELDS).
SCREEN_COLUMNS = (
    ("c", "concurrency (or rate)"),
    ("ok", "level valid"),
    ("conc", "achieved_concurrency"),
    ("req/s", "requests_per_s"),
    ("tok/s", "output_tokens_per_s"),
    ("TTFT95", "ttft_p95_ms"),
    ("TPOT50", "tpot_p50_ms"),
    ("E2E99", "e2e_p99_ms"),
    ("err%", "error_rate"),
    ("wait", "server_waiting_mean"),
)


def summary_table(report: dict[str, Any]) -> Table:
    """The on-screen table: ten short columns (ms for latencies) that fit 80 columns without truncation."""
    table = Table(
        title=f"plimsoll bench {report['kind']}: {report['server']['model']} @ {report['server']['url']}",
        caption="latencies in ms; all columns in the CSV and JSON beside --output",
        padding=(0, 1),
    )
    for header, _ in SCREEN_COLUMNS:
        # fold, never "…": a squeezed cell wraps onto a second line instead of losing digits
        table.add_column(header, justify="right", overflow="fold", no_wrap=False)
    for lv in report["levels"]:
        row = level_row(lv)
        label = str(lv["concurrency"]) if lv["concurrency"] is not None else f"{lv['rate']:g}/s"
        table.add_row(
            label,
            "yes" if lv["valid"] else "NO",
            _fmt(row["achieved_concurrency"]),
            _fmt(row["requests_per_s"], 2),
            _fmt(row["output_tokens_per_s"]),
            _fmt(row["ttft_p95_ms"]),
            _fmt(row["tpot_p50_ms"]),
            _fmt(row["e2e_p99_ms"]),
            _fmt(100 * row["error_rate"]),
            _fmt(row["server_waiting_mean"]),
        )
    return table


def knee_lines(report: dict[str, Any]) -> list[str]:
    thr, lat, rec = report["knees"]["throughput"], report["knees"]["latency"], report["recommendation"]
    if report["kind"] == "spec_ab":
        lines = _spec_ab_lines(report["scenario"])
    elif report["kind"] == "run":
        lines = _single_level_lines(report)
    else:
        lines = _knee_lines(thr, lat, rec)
    note = (lat.get("confidence") or {}).get("note")
    if report["kind"] != "run" and note:
        lines.append(f"confidence: {lat['confidence']['rating']} — {note}")
    verification = report.get("verification")
    if verification is not None:
        for t in verification["tried"]:
            lines.append(
                f"hold c={t['concurrency']} for {t['seconds']:g} s: {'held' if t['passed'] else 'missed'} — {t['why']}"
            )
    for lv in report["levels"]:
        if not lv["valid"]:
            label = lv["concurrency"] if lv["concurrency"] is not None else lv["rate"]
            lines.append(f"level {label} invalid: {'; '.join(lv['invalid_reasons'])}")
    lines.extend(f"warning: {w}" for w in report["warnings"])
    return lines


def _spec_ab_lines(ab: dict[str, Any]) -> list[str]:
    """`bench spec-ab`: the decision first, then the figures it rests on."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.0%}"

    rate = ab.get("acceptance_rate")
    accepted = (
        "n/a"
        if rate is None
        else f"{rate:.0%} ({ab['accepted_tokens']:.0f} of {ab['draft_tokens']:.0f} drafts)"
    )
    base, spec = ab["arms"]["baseline"], ab["arms"]["speculative"]
    return [
        f"speculative config: {ab['recommendation'].upper()} — {ab['why']}",
        f"gain: TPOT p50 {pct(ab['gain']['tpot_p50'])}, E2E p50 {pct(ab['gain']['e2e_p50'])}, output tokens/s "
        f"{pct(ab['gain']['output_tokens_per_s'])}; acceptance rate {accepted}",
        f"baseline {ab['baseline_url']}: {base['requests']} requests in {base['windows']} windows; speculative "
        f"{ab['speculative_url']}: {spec['requests']} requests (rows alternate baseline, speculative)",
    ]


def _single_level_lines(report: dict[str, Any]) -> list[str]:
    """`bench run`: one level has no knee; say what the server did at it instead."""
    lines = []
    for lv in report["levels"]:
        srv = lv.get("server") or {}
        running, waiting = srv.get("running"), srv.get("waiting")
        if running and waiting and waiting["mean"] >= 0.5:
            lines.append(
                f"server queue at c={lv['concurrency']}: {waiting['mean']:.1f} waiting beside "
                f"{running['mean']:.1f} running on average, so this level is past the server's batch; "
                "`plimsoll diagnose` names the limit"
            )
    levels = ",".join(str(c) for c in _sweep_levels(report["levels"][0]["concurrency"] or 1))
    lines.append(
        "one level has no knee or recommendation; for those run "
        f"`plimsoll bench sweep --levels {levels}` against the same server"
    )
    return lines


def _sweep_levels(c: int) -> list[int]:
    """Doubling levels from 1 to at least twice ``c``: a sweep that brackets the run's level."""
    levels = [1]
    while levels[-1] < 2 * c:
        levels.append(levels[-1] * 2)
    return levels


def _knee_lines(thr: dict[str, Any], lat: dict[str, Any], rec: dict[str, Any]) -> list[str]:
    return [
        f"throughput knee: {thr['concurrency'] if thr['concurrency'] is not None else 'none'} — {thr['reason']}"
        + (
            f" (Kneedle on an even grid: {thr['kneedle_concurrency']:.1f})"
            if thr.get("kneedle_concurrency")
            else ""
        ),
        f"latency knee: {lat['concurrency'] if lat['concurrency'] is not None else 'none'} — {lat['reason']}",
        f"recommended concurrency per replica: {rec['concurrency_per_replica']} — {rec['reason']}",
    ]


def model_lines(report: dict[str, Any]) -> list[str]:
    """With --models: one line per level giving each model's output tok/s and TPOT p50 (ms)."""
    lines = []
    for lv in report["levels"]:
        by_model = lv.get("by_model")
        if not by_model:
            continue
        label = f"c={lv['concurrency']}" if lv["concurrency"] is not None else f"{lv['rate']:g}/s"
        parts = [
            f"{name} {_fmt(fig['output_tokens_per_s'])} tok/s, TPOT p50 "
            f"{_fmt((fig['tpot'] or {}).get('p50'))} ms ({fig['completed']} ok)"
            for name, fig in by_model.items()
        ]
        lines.append(f"{label} per model: " + "; ".join(parts))
    return lines


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(summary_table(report))
    for line in [*model_lines(report), *knee_lines(report)]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
