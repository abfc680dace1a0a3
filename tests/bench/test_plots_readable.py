"""Plot ticks read 1, 2, 4; the limit that decided the latency knee is drawn; the knee
marker sits at the knee, not on the nearest level."""

import math
from typing import Any

import numpy as np
import pytest
from benchkit import sweep_simulator

from plimsoll.bench.plots import latency_figure, latency_throughput_figure, throughput_figure
from plimsoll.bench.simulator import ServiceCurve


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    # batch cap 2: latency climbs past 2, so the latency knee lies inside the levels
    return sweep_simulator(ServiceCurve(batch_cap=2, step_t0_s=0.02), (1, 2, 4, 8), min_concurrency_ratio=0.5)


def test_ticks_are_plain_numbers(report: dict[str, Any]) -> None:
    fig = throughput_figure(report)
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["1", "2", "4", "8"]


def test_the_deciding_limit_is_drawn(report: dict[str, Any]) -> None:
    lat = report["knees"]["latency"]
    assert lat["concurrency"] is not None, lat["reason"]
    # Without an SLO the simulator's knee is where its queue begins: the knee line says so.
    assert lat["binding"] == "queueing", lat["reason"]
    labels = [line.get_label() for line in latency_figure(report).axes[0].get_lines()]
    assert any(lb.startswith("latency knee") and "queueing begins" in lb for lb in labels), labels
    # A knee decided by an SLO draws that SLO's line on its panel.
    slo_report = {
        **report,
        "slo": {**report["slo"], "ttft_p95_ms": 55.0},
        "knees": {**report["knees"], "latency": {**lat, "basis": "slo", "binding": "ttft_p95"}},
    }
    labels = [line.get_label() for line in latency_figure(slo_report).axes[0].get_lines()]
    assert any(lb.startswith("limit: SLO TTFT") and lb.endswith("(decided the knee)") for lb in labels), (
        labels
    )


def test_knee_marker_is_at_the_knee(report: dict[str, Any]) -> None:
    c = report["knees"]["latency"]["concurrency"]
    levels = sorted((lv for lv in report["levels"] if lv["valid"]), key=lambda lv: lv["concurrency"])
    xs = [math.log2(lv["concurrency"]) for lv in levels]
    want_x = np.interp(math.log2(c), xs, [lv["throughput"]["output_tokens_per_s"] for lv in levels])
    fig = latency_throughput_figure(report)
    marker = next(col for col in fig.axes[0].collections if "latency knee" in col.get_label())
    assert marker.get_offsets()[0][0] == pytest.approx(want_x)
