"""Must-show 2: the CLI's JSON report validates against the shipped schema; CSV, JSONL, PNG and HTML are written.

Also: bad input (unreachable URL, wrong model, erroring server, bad flags) exits
non-zero with a clear message and writes no report.
"""

import copy
import csv
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from plimsoll.bench.report import schema, validate
from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.cli import app

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "bench" / "report.schema.json"
# A cap of 4 inside levels 1-8 keeps the knee (and so the recommendation, at least
# floor(0.75 x 2) = 1) well defined even when a loaded CI machine adds noise.
FAST = ServiceCurve(batch_cap=4, step_t0_s=0.05)


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with running_simulator(FAST) as url:
        yield url


def sweep_args(url: str, *extra: str) -> list[str]:
    return [
        "bench",
        "sweep",
        "--url",
        url,
        "--levels",
        "1,2,4,8",
        "--input-tokens",
        "16",
        "--output-tokens",
        "4",
        "--duration-per-level",
        "0.8",
        "--max-client-lag-ms",
        "1000",
        "--min-concurrency-ratio",
        "0.8",
        *extra,
    ]


@pytest.fixture(scope="module")
def report_dir(sim_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    result = CliRunner().invoke(app, sweep_args(sim_url, "--output", str(out / "sweep.json")))
    assert result.exit_code == 0, result.output
    assert "recommended concurrency per replica" in result.output
    return out


@pytest.mark.slow
def test_json_report_validates_against_shipped_schema(report_dir: Path) -> None:
    report = json.loads((report_dir / "sweep.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA_FILE.read_text()))
    assert report["schema_version"] == "1.0"
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2, 4, 8]
    assert report["server"]["engine_family"] == "plimsoll"
    assert report["server"]["model"] == "sim-model"
    lv = report["levels"][-1]
    # the server's own gauges were scraped during the level
    assert lv["server"]["running"]["samples"] >= 2 and lv["server"]["running"]["max"] >= 1
    assert lv["server"]["waiting"] is not None and lv["server"]["kv_usage"] is not None
    assert lv["latency_ms"]["tpot"]["p50"] > 0 and lv["throughput"]["output_tokens_per_s"] > 0
    # the operator's contract
    assert "concurrency" in report["knees"]["throughput"] and "concurrency" in report["knees"]["latency"]
    assert isinstance(report["recommendation"]["concurrency_per_replica"], int)


@pytest.mark.slow
def test_csv_jsonl_plots_and_html_are_written(report_dir: Path) -> None:
    rows = list(csv.DictReader((report_dir / "sweep.csv").open()))
    assert [r["concurrency"] for r in rows] == ["1", "2", "4", "8"]
    lines = [json.loads(line) for line in (report_dir / "sweep.requests.jsonl").read_text().splitlines()]
    measured = [x for x in lines if x["measured"]]
    assert measured and all(x["ok"] and x["output_tokens"] == 4 for x in measured)
    assert all(x["ttft_ms"] > 0 and x["tpot_ms"] > 0 for x in measured)
    for name in ("throughput", "latency", "latency_vs_throughput"):
        png = (report_dir / f"sweep.{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    page = (report_dir / "sweep.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<table>" in page and "throughput knee" in page


@pytest.mark.slow
def test_schema_rejects_a_report_that_breaks_the_contract(report_dir: Path) -> None:
    report = json.loads((report_dir / "sweep.json").read_text())
    validate(report)
    for breakage in ("drop_recommendation", "zero_concurrency", "bad_version"):
        broken = copy.deepcopy(report)
        if breakage == "drop_recommendation":
            del broken["recommendation"]
        elif breakage == "zero_concurrency":
            broken["recommendation"]["concurrency_per_replica"] = 0
        else:
            broken["schema_version"] = "0.9"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema())


def test_unreachable_url_fails_clearly(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, sweep_args("http://127.0.0.1:9", "--output", str(out)))
    assert result.exit_code == 1
    assert "cannot reach" in result.output and not out.exists()


def test_wrong_model_fails_clearly(sim_url: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, sweep_args(sim_url, "--model", "nope", "--output", str(tmp_path / "r.json"))
    )
    assert result.exit_code == 1
    assert "does not serve model 'nope'" in result.output and "sim-model" in result.output


def test_erroring_server_fails_clearly(tmp_path: Path) -> None:
    with running_simulator(ServiceCurve(error_rate=1.0)) as url:
        result = CliRunner().invoke(app, sweep_args(url, "--output", str(tmp_path / "r.json")))
    assert result.exit_code == 1
    assert "http_500" in result.output and "injected simulator fault" in result.output
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--input-tokens", "lots"], "cannot read token length"),
        (["--levels", "1,two"], "cannot read levels"),
        (["--headroom", "1.5"], "headroom"),
    ],
)
def test_bad_flags_exit_2_with_reason(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(app, sweep_args("http://127.0.0.1:9", *flags))
    assert result.exit_code == 2
    assert message in result.output


# The client-overload gate is loosened: a loaded CI machine lags its event loop.
SHAPE = ["--input-tokens", "8", "--output-tokens", "3", "--max-client-lag-ms", "1000"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        [
            "run",
            "-c",
            "2",
            "--duration-per-level",
            "0.5",
            "--max-client-lag-ms",
            "1000",
            "--min-concurrency-ratio",
            "0.8",
        ],
        [
            "rate",
            "--rate",
            "4,8",
            "--arrival",
            "bursty",
            "--duration-per-level",
            "0.6",
            "--warmup-seconds",
            "0.2",
        ],
        ["baseline", "--requests", "3"],
        ["burst", "--steady-rate", "4", "--burst-requests", "6", "--before", "0.5", "--after", "1"],
        ["soak", "-c", "2", "--duration", "1", "--window", "0.5"],
    ],
    ids=["run", "rate", "baseline", "burst", "soak"],
)
def test_every_command_writes_a_valid_report(sim_url: str, tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", *args, "--url", sim_url, *SHAPE, "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    validate(report)
    assert report["kind"] == args[0] and report["levels"]
    assert (tmp_path / "r.csv").exists() and (tmp_path / "r.requests.jsonl").exists()
