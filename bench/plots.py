"""Plots of a sweep report (PNG) and a self-contained HTML page.

What it is: matplotlib (Agg backend, no display) figures — throughput vs
concurrency with the 90% line and the throughput knee, latency percentiles vs
concurrency with the latency knee, and latency vs throughput with both knees —
and an HTML file embedding them as base64 PNGs beside the summary tables.
What it is not: interactive; it reads only the JSON report.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from plimsoll.bench.knees import TPOT_INFLATION, TTFT_INFLATION
from plimsoll.bench.report import knee_lines, level_row


def _closed_levels(report: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(
        (lv for lv in report["levels"] if lv["concurrency"] is not None), key=lambda lv: lv["concurrency"]
    )


def _level_ticks(ax: Any, levels: list[dict[str, Any]]) -> None:
    """Log-2 axis labelled with the swept levels as plain numbers (1, 2, 4), not 2⁰ 2¹ 2²."""
    ax.set_xscale("log", base=2)
    cs = sorted({lv["concurrency"] for lv in levels})
    if cs:
        ax.set_xticks(cs)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _interpolate(levels: list[dict[str, Any]], c: float, value: Any) -> float:
    """``value(level)`` at concurrency ``c``, linear in log2(c) between the levels around it."""
    xs = [math.log2(lv["concurrency"]) for lv in levels]
    return float(np.interp(math.log2(c), xs, [value(lv) for lv in levels]))


def _binding_limit(report: dict[str, Any], metric: str) -> tuple[float, str] | None:
    """The latency limit (ms) on ``metric`` that decided the latency knee, with its label."""
    lat = report["knees"]["latency"]
    binding = lat.get("binding")
    if not binding or not binding.startswith(metric):
        return None
    pct = binding.split("_")[1]
    if lat.get("basis") == "slo":
        value = report["slo"].get(f"{binding}_ms")
        return (value, f"SLO {metric.upper()} {pct} (decided the knee)") if value else None
    base = next((lv for lv in _closed_levels(report) if lv["valid"] and lv["latency_ms"].get(metric)), None)
    value = (lat.get("limits_ms") or {}).get(binding)
    if base is None or value is None:
        return None
    factor = TTFT_INFLATION if metric == "ttft" else TPOT_INFLATION
    return value, f"max({factor:g}×, floor) of c={base['concurrency']} {pct} (decided the knee)"


def _mark_knees(ax: Any, report: dict[str, Any]) -> None:
    thr = report["knees"]["throughput"]["concurrency"]
    lat = report["knees"]["latency"]["concurrency"]
    rec = report["recommendation"]["concurrency_per_replica"]
    if thr is not None:
        ax.axvline(thr, color="tab:red", linestyle="--", label=f"throughput knee c={thr}")
    if lat is not None:
        queue = report["knees"]["latency"].get("binding") == "queueing"
        label = f"latency knee c={lat:g}" + (" (queueing begins)" if queue else "")
        ax.axvline(lat, color="tab:purple", linestyle="--", label=label)
    if rec is not None:
        ax.axvline(rec, color="tab:green", linestyle=":", label=f"recommended c={rec}")


def throughput_figure(report: dict[str, Any]) -> Figure:
    levels = _closed_levels(report)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for valid, marker in ((True, "o"), (False, "x")):
        pts = [
            (lv["concurrency"], lv["throughput"]["output_tokens_per_s"])
            for lv in levels
            if lv["valid"] == valid
        ]
        if pts:
            ax.plot(
                *zip(*pts, strict=True),
                marker=marker,
                linestyle="-" if valid else "none",
                label="output tok/s" if valid else "invalid level",
            )
    best = report["knees"]["throughput"].get("best_output_tokens_per_s")
    alpha = report["knees"]["throughput"].get("alpha", 0.9)
    if best:
        ax.axhline(alpha * best, color="grey", linestyle=":", label=f"{alpha:.0%} of best")
    _mark_knees(ax, report)
    _level_ticks(ax, levels)
    ax.set_xlabel("concurrency (clients in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def latency_figure(report: dict[str, Any]) -> Figure:
    levels = [lv for lv in _closed_levels(report) if lv["valid"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    cs = [lv["concurrency"] for lv in levels]
    for ax, metric, title in ((ax1, "ttft", "TTFT"), (ax2, "tpot", "TPOT")):
        for pct in ("p50", "p90", "p95", "p99"):
            ys = [
                lv["latency_ms"][metric][pct] if lv["latency_ms"][metric] else float("nan") for lv in levels
            ]
            ax.plot(cs, ys, marker=".", label=pct)
        slo = report["slo"].get("ttft_p95_ms" if metric == "ttft" else "tpot_p50_ms")
        limit = _binding_limit(report, metric)
        if limit is not None:
            ax.axhline(limit[0], color="tab:purple", linestyle="-.", label=f"limit: {limit[1]}")
        elif slo:
            ax.axhline(slo, color="black", linestyle="-.", label="SLO")
        _mark_knees(ax, report)
        _level_ticks(ax, levels)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} percentiles vs concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    return fig


def latency_throughput_figure(report: dict[str, Any]) -> Figure:
    levels = [lv for lv in _closed_levels(report) if lv["valid"] and lv["latency_ms"]["e2e"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [lv["throughput"]["output_tokens_per_s"] for lv in levels]
    ys = [lv["latency_ms"]["e2e"]["p95"] for lv in levels]
    ax.plot(xs, ys, marker="o", label="E2E p95")
    for lv, x, y in zip(levels, xs, ys, strict=True):
        ax.annotate(
            f"c={lv['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small"
        )
    knees = {
        "throughput knee": report["knees"]["throughput"]["concurrency"],
        "latency knee": report["knees"]["latency"]["concurrency"],
    }
    for (name, c), color in zip(knees.items(), ("tab:red", "tab:purple"), strict=True):
        if c is None or not levels:
            continue
        # At the knee itself (a latency knee lies between levels), not on the nearest level.
        x = _interpolate(levels, c, lambda lv: lv["throughput"]["output_tokens_per_s"])
        y = _interpolate(levels, c, lambda lv: lv["latency_ms"]["e2e"]["p95"])
        ax.scatter(
            [x], [y], s=160, facecolors="none", edgecolors=color, linewidths=2, label=f"{name} (c={c:.3g})"
        )
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("E2E p95 (ms)")
    ax.set_title("Latency vs throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


FIGURES = {
    "throughput": throughput_figure,
    "latency": latency_figure,
    "latency_vs_throughput": latency_throughput_figure,
}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def render_html(report: dict[str, Any], pngs: dict[str, bytes]) -> str:
    rows = [level_row(lv) for lv in report["levels"]]
    cols = list(rows[0]) if rows else []

    def cell(v: Any) -> str:
        return html.escape(f"{v:.2f}" if isinstance(v, float) else str(v))

    table = "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"
    table += (
        "".join("<tr>" + "".join(f"<td>{cell(r[c])}</td>" for c in cols) + "</tr>" for r in rows) + "</table>"
    )
    imgs = "".join(
        f'<h2>{html.escape(name)}</h2><img alt="{html.escape(name)}" '
        f'src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        for name, data in pngs.items()
    )
    notes = "".join(f"<li>{html.escape(line)}</li>" for line in knee_lines(report))
    server = report["server"]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>plimsoll bench: {html.escape(server["model"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}img{{max-width:100%}}</style></head>
<body><h1>plimsoll bench {html.escape(report["kind"])}: {html.escape(server["model"])}</h1>
<p>{html.escape(server["url"])} — {html.escape(report["created_at"])} — schema {html.escape(report["schema_version"])}</p>
<h2>Knees and recommendation</h2><ul>{notes}</ul>
<h2>Levels</h2>{table}{imgs}</body></html>
"""


def write_plots(report: dict[str, Any], output: Path) -> list[Path]:
    """PNG per figure and one HTML page, named after ``output``; empty for non-sweep reports."""
    if not _closed_levels(report):
        return []
    stem = output.with_suffix("")
    pngs = {name: _png(make(report)) for name, make in FIGURES.items()}
    paths = []
    for name, data in pngs.items():
        path = Path(f"{stem}.{name}.png")
        path.write_bytes(data)
        paths.append(path)
    page = Path(f"{stem}.html")
    page.write_text(render_html(report, pngs))
    return [*paths, page]
