"""Diagnose judges decode against an SLO or the server's own c=1 TPOT, says why in
numbers, shows it is watching, and every piece of advice names a flag `plimsoll serve` has."""

import json
import re
from pathlib import Path

from test_diagnose import Scenario, metrics_server, timeline
from typer.testing import CliRunner

from plimsoll import metric_names as mn
from plimsoll.bench.diagnose import ADVICE
from plimsoll.cli import app

# A CPU server: every token takes 150 ms, steadily (no spread), with no queue.
CPU_STEADY = Scenario(tpots_s=(0.15,), running=4)


def diagnose(scenario: Scenario, *extra: str) -> tuple[int, str]:
    with metrics_server(timeline(mn.PLIMSOLL, scenario)) as url:
        result = CliRunner().invoke(
            app, ["diagnose", "--url", url, "--window", "0.2", "--interval", "0.1", *extra]
        )
    return result.exit_code, result.output


def test_a_steady_cpu_server_is_not_called_decode_bound_by_a_fixed_number() -> None:
    code, out = diagnose(CPU_STEADY)
    assert code == 0, out
    assert "verdict: none" in out
    assert "note: decode speed not judged (only its spread): give --slo-tpot-p50-ms, or --baseline" in out
    assert out.splitlines()[0].startswith("watching http://127.0.0.1:")  # says what it is doing first


def test_slo_and_baseline_give_the_decode_limit_in_numbers(tmp_path: Path) -> None:
    code, out = diagnose(CPU_STEADY, "--slo-tpot-p50-ms", "100")
    assert code == 0, out
    assert "verdict: decode" in out
    assert re.search(r"mean TPOT 1\d\d ms is above 100 ms \(the SLO --slo-tpot-p50-ms 100\)", out), out
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"levels": [{"concurrency": 1, "latency_ms": {"tpot": {"p50": 140.0}}}]}))
    code, out = diagnose(CPU_STEADY, "--baseline", str(baseline))
    assert code == 0, out
    assert "verdict: none" in out  # 150 ms is not twice the server's own 140 ms
    slow = Scenario(tpots_s=(0.4,), running=4)
    code, out = diagnose(slow, "--baseline", str(baseline))
    assert code == 0, out
    assert "verdict: decode" in out
    assert "(2× this server's c=1 TPOT p50 of 140 ms in baseline.json)" in out


def test_bad_baseline_is_one_line_with_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "b.json"
    bad.write_text("{}")
    result = CliRunner().invoke(app, ["diagnose", "--url", "http://127.0.0.1:9", "--baseline", str(bad)])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: --baseline {bad}: no c=1 level with TPOT in it (KeyError); "
        "write one with `plimsoll bench baseline --url URL -o baseline.json`"
    )


def test_every_flag_in_the_advice_exists_on_plimsoll_serve() -> None:
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250"}).output
    named = {flag for tips in ADVICE.values() for tip in tips for flag in re.findall(r"--[a-z][a-z-]+", tip)}
    assert named, "advice names flags"
    assert {f for f in named if f not in help_text} == set()
