"""The summary table fits 80 and 120 columns; small samples and empty windows are named."""

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from plimsoll.bench.report import SCREEN_COLUMNS, level_row, summary_table
from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.cli import app

SHAPE = ["--input-tokens", "8", "--output-tokens", "4", "--max-client-lag-ms", "1000"]


@pytest.fixture(scope="module")
def sim_url():
    with running_simulator(ServiceCurve(batch_cap=2, step_t0_s=0.01)) as url:
        yield url


@pytest.fixture(scope="module")
def report(sim_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("screen") / "r.json"
    args = ["bench", "sweep", "--url", sim_url, "--levels", "1,2,4", "--requests-per-level", "8", *SHAPE]
    result = CliRunner().invoke(app, [*args, "--min-concurrency-ratio", "0.5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("width", [80, 120])
def test_table_fits_the_terminal_with_no_cell_cut_to_an_ellipsis(report: dict, width: int) -> None:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False).print(summary_table(report))
    text = buf.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for header, _ in SCREEN_COLUMNS:
        assert header in text
    for lv in report["levels"]:
        row = level_row(lv)
        assert f"{row['output_tokens_per_s']:.1f}" in text  # every on-screen figure whole
        assert f"{row['ttft_p95_ms']:.1f}" in text


def test_few_requests_warn_on_screen_and_in_the_report(report: dict, sim_url: str) -> None:
    warning = next(w for w in report["warnings"] if w.startswith("few samples:"))
    assert "c=1 (8 requests)" in warning and "raise --requests-per-level to 100 or more" in warning
    result = CliRunner().invoke(
        app, ["bench", "run", "--url", sim_url, "-c", "1", "--requests-per-level", "2", *SHAPE]
    )
    assert result.exit_code == 0, result.output
    lines = [
        ln for ln in result.output.splitlines() if ln.startswith("warning: few samples: c=1 (2 requests)")
    ]
    assert len(lines) == 1 and lines[0].endswith("raise --requests-per-level to 100 or more")


def test_one_request_per_level_names_the_empty_window(sim_url: str) -> None:
    args = [
        "bench",
        "run",
        "--url",
        sim_url,
        "-c",
        "1",
        "--requests-per-level",
        "1",
        "--warmup-requests",
        "1",
    ]
    result = CliRunner().invoke(app, [*args, *SHAPE])
    assert result.exit_code == 1
    assert "achieved concurrency 0.00" not in result.output
    assert (
        "measurement window of its 1 request(s) held no request in flight (it closes at the last measured send); "
        "raise --requests-per-level (100 or more) or use --duration-per-level"
    ) in result.output
    assert "Traceback" not in result.output


def test_bench_run_reports_the_queue_not_a_sweep_recommendation(sim_url: str) -> None:
    # batch cap 2 under 8 clients: 6 wait beside 2 running, as `diagnose` says
    args = ["bench", "run", "--url", sim_url, "-c", "8", "--requests-per-level", "24", *SHAPE]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "extend --levels" not in result.output and "recommended concurrency" not in result.output
    queue = [ln for ln in result.output.splitlines() if ln.startswith("server queue at c=8: ")]
    assert len(queue) == 1 and "running on average, so this level is past the server's batch" in queue[0]
    assert (
        "one level has no knee or recommendation; for those run "
        "`plimsoll bench sweep --levels 1,2,4,8,16` against the same server"
    ) in result.output
