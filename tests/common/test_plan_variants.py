"""`plimsoll plan-variants` through the real CLI: reports read as the profile Job reads them, the optimiser's mix."""

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from plimsoll.cli import app

runner = CliRunner()


def report(tmp_path: Path, name: str, recommended: int, e2e_ms: float) -> Path:
    """A sweep report recommending ``recommended`` in flight, ``e2e_ms`` each at every level."""
    levels = [
        {"concurrency": c, "valid": True,
         "latency_ms": {"ttft": {"mean": 50, "p50": 50, "p95": 60}, "tpot": {"mean": 20, "p50": 20, "p95": 25},
                        "e2e": {"mean": e2e_ms, "p50": e2e_ms, "p95": e2e_ms}}}
        for c in (1, 4, 8, 16)
    ]  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "schema_version": "1.0", "levels": levels,
        "knees": {"throughput": {"concurrency": 16}, "latency": {"concurrency": None}},
        "recommendation": {"concurrency_per_replica": recommended, "headroom": 0.75},
    }))  # fmt: skip
    return path


def run(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["plan-variants", *args, "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def test_the_cheapest_mix_from_one_report_per_variant(tmp_path: Path) -> None:
    # h100: 12 in flight at 0.5 s = 24 req/s for 4/h; l4: 4 at 1 s = 4 req/s for 1/h.
    h100, l4 = report(tmp_path, "h100", 12, 500), report(tmp_path, "l4", 4, 1000)
    plan = run("--variant", f"h100={h100}:4.0:4", "--variant", f"l4={l4}:1.0:6", "--target-rps", "30")
    rows = {v["name"]: v for v in plan["variants"]}
    assert (
        rows["h100"]["requestsPerSecondPerReplica"] == 24 and rows["l4"]["requestsPerSecondPerReplica"] == 4
    )
    # 30 req/s: h100 + 2 l4 (32, 6/h) beats 2 h100 (48, 8/h) and h100 + 6 l4 is more than needed.
    assert plan["chosen"]["replicas"] == {"h100": 1, "l4": 2} and plan["chosen"]["costPerHour"] == 6.0
    assert plan["chosen"]["costPer1kRequests"] == round(6.0 / (30 * 3.6), 6)
    assert plan["runnerUp"]["describe"] == "h100 × 2" and "8/h" in plan["runnerUp"]["whyNot"]
    text = runner.invoke(app, ["plan-variants", "--variant", f"h100={h100}:4.0:4", "--variant", f"l4={l4}:1.0:6",
                               "--target-rps", "30"]).output  # fmt: skip
    assert "Mix: h100 × 1 + l4 × 2: carries 32 requests/s, 6/h" in text and "Runner-up: h100 × 2" in text


def test_the_spot_limit_and_a_demand_beyond_every_maximum(tmp_path: Path) -> None:
    h100, mig = report(tmp_path, "h100", 12, 500), report(tmp_path, "mig", 4, 1000)
    args = ["--variant", f"h100={h100}:4.0:2", "--variant", f"mig={mig}:0.5:8:spot"]
    assert run(*args, "--target-rps", "8")["chosen"]["replicas"] == {"h100": 0, "mig": 2}
    limited = run(*args, "--target-rps", "8", "--max-spot-fraction", "0.25")
    assert limited["chosen"]["replicas"] == {"h100": 1, "mig": 0}
    beyond = run(*args, "--target-rps", "200")
    assert beyond["chosen"]["replicas"] == {"h100": 2, "mig": 8} and beyond["shortfallRps"] == 200 - 48 - 32


def test_bad_variants_are_refused_saying_how_to_fix_them(tmp_path: Path) -> None:
    good = report(tmp_path, "ok", 12, 500)
    for arg, says in (
        ("h100", "give --variant NAME=REPORT.json:COST_PER_HOUR"),
        (f"h100={good}:cheap", "cost must be a number"),
        (f"h100={good}:1.0:4:preemptible", "the fourth field can only be 'spot'"),
        (f"h100={tmp_path / 'missing.json'}:1.0", "cannot read the bench report"),
    ):
        result = runner.invoke(app, ["plan-variants", "--variant", arg, "--target-rps", "1"])
        assert result.exit_code == 2 and says in result.output, (arg, result.output)
    twice = runner.invoke(app, ["plan-variants", "--variant", f"a={good}:1", "--variant", f"a={good}:2",
                                "--target-rps", "1"])  # fmt: skip
    assert twice.exit_code == 2 and "must be unique" in twice.output
