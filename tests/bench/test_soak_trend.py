"""`bench soak` flags a leak by its trend: an injected one is flagged, a clean server is not.

The simulator runs in its own process with its process_* series on; the leaky one keeps
a file descriptor and 256 KiB per finished request. Windows are short (0.5 s) but hold
many requests each, so the leak grows in every window however fast this machine is;
nothing here depends on timing beyond that. Latency is left out of the clean run's
assertion: in half-second windows on a shared CPU it is noise.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.bench.trend import fit_trend, is_upward
from plimsoll.cli import app

RESOURCES = {"open_fds_mean", "resident_memory_mean", "http_connections_mean", "kv_usage_mean"}
SOAK = [
    "-c", "2", "--duration", "3.5s", "--window", "0.5", "--input-tokens", "8", "--output-tokens", "4",
    "--max-client-lag-ms", "1000", "--max-error-rate", "0.2", "--min-concurrency-ratio", "0.5",
]  # fmt: skip


def soak(curve: ServiceCurve, out: Path) -> tuple[str, dict]:
    with running_simulator(curve) as url:
        result = CliRunner().invoke(app, ["bench", "soak", "--url", url, *SOAK, "-o", str(out)])
    assert result.exit_code == 0, result.output
    return result.output, json.loads(out.read_text())


def test_an_injected_leak_is_flagged_with_its_slope(tmp_path: Path) -> None:
    leaky = ServiceCurve(
        batch_cap=4, step_t0_s=0.005, leak_fds_per_request=1, leak_bytes_per_request=256 * 1024
    )
    output, report = soak(leaky, tmp_path / "leaky.json")
    scenario = report["scenario"]
    assert {"open_fds_mean", "resident_memory_mean"} <= set(scenario["rising"]), scenario["trend"]
    fds = scenario["trend"]["open_fds_mean"]
    assert fds["slope_per_s"] > 0 and fds["slope_ci95"][0] > 0 and fds["p_value"] < 0.05
    assert fds["kendall_tau"] > 0.9
    assert "upward trend: open_fds_mean rises" in output and "95% CI" in output


def test_a_clean_server_is_not_flagged(tmp_path: Path) -> None:
    clean = ServiceCurve(batch_cap=4, step_t0_s=0.005, process_metrics=True)
    output, report = soak(clean, tmp_path / "clean.json")
    scenario = report["scenario"]
    assert scenario["trend"]["open_fds_mean"] is not None  # the series was there and was judged
    assert scenario["trend"]["resident_memory_mean"] is not None
    # What a leak grows. (Latency in 0.5 s windows on a shared CPU is noise both checks may catch.)
    assert not set(scenario["drifting"]) & RESOURCES, scenario["trend"]
    assert not any(f"upward trend: {name}" in output for name in RESOURCES)


@pytest.mark.parametrize(
    ("values", "upward"),
    [
        ([10, 11, 12, 13, 14, 15, 16, 17], True),  # a steady rise
        ([10, 10, 10, 10, 10, 10, 10, 10], False),  # flat
        ([10, 11, 10, 11, 10, 11, 10, 11], False),  # noise, no trend
        ([10, 10.01, 10.02, 10.03, 10.04, 10.05, 10.06, 10.07], False),  # monotone but under the minimum rise
        ([17, 16, 15, 14, 13, 12, 11, 10], False),  # falling
    ],
)
def test_the_trend_rule(values: list[float], upward: bool) -> None:
    fit = fit_trend(list(range(len(values))), values)
    assert is_upward(fit, 0.05) is upward, fit


def test_a_fraction_must_also_rise_by_a_share_of_the_whole_to_drift() -> None:
    from plimsoll.bench.scenarios import _drift

    near_empty = [0.002, 0.002, 0.002, 0.003, 0.003, 0.003]  # +50 %, a thousandth of the cache
    assert _drift(near_empty) == pytest.approx(0.5)
    assert _drift(near_empty, min_absolute=0.05) == 0.0
    filling = [0.2, 0.2, 0.2, 0.3, 0.3, 0.3]  # +50 %, a tenth of the cache: a leak's shape
    assert _drift(filling, min_absolute=0.05) == pytest.approx(0.5)
