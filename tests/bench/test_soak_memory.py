"""`bench soak` sees plimsoll's resident memory, and a drift check without data says so."""

import json
from pathlib import Path

from typer.testing import CliRunner

from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.cli import app

# The tiny random model's 4-token requests end so fast that the client's own gaps between requests
# show as concurrency below 2, and a stray error may void a level: neither may void a test about
# memory series.
SOAK = [
    "--input-tokens", "8", "--output-tokens", "4", "--max-client-lag-ms", "1000",
    "--max-error-rate", "0.2", "--min-concurrency-ratio", "0.5",
]  # fmt: skip


def soak(url: str, out: Path) -> tuple[int, str, dict]:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "soak",
            "--url",
            url,
            "-c",
            "2",
            "--duration",
            "1.5",
            "--window",
            "0.5",
            *SOAK,
            "-o",
            str(out),
        ],
    )
    return result.exit_code, result.output, json.loads(out.read_text()) if out.exists() else {}


def test_plimsoll_metrics_expose_process_memory() -> None:
    from plimsoll.runtime.serving.metrics import ServerMetrics

    text = ServerMetrics("m").exposition()[0].decode()
    assert "process_resident_memory_bytes" in text
    assert "python_gc_objects_collected_total" in text


def test_soak_against_plimsoll_serve_records_resident_memory(tmp_path: Path) -> None:
    from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    with ThreadedServer(model, max_num_seqs=2) as server:
        code, output, report = soak(server.url, tmp_path / "soak.json")
    assert code == 0, output
    memory = [lv["server"]["resident_memory_bytes"] for lv in report["levels"]]
    assert all(m is not None and m["mean"] > 1e6 for m in memory), memory
    assert report["scenario"]["drift"]["resident_memory_mean"] is not None
    assert "resident_memory_mean" not in report["scenario"]["unchecked"]
    # Open fds and HTTP connections too (the scrape's own connection is one of them).
    for lv in report["levels"]:
        assert lv["server"]["open_fds"]["mean"] > 3 and lv["server"]["http_connections"]["mean"] >= 1, lv[
            "server"
        ]
    assert {"open_fds_mean", "http_connections_mean"}.isdisjoint(report["scenario"]["unchecked"])


def test_soak_without_memory_series_says_the_check_has_no_data(tmp_path: Path) -> None:
    # The simulator exposes engine gauges but no process_* series.
    with running_simulator(ServiceCurve(batch_cap=4, step_t0_s=0.01)) as url:
        code, output, report = soak(url, tmp_path / "soak.json")
    assert code == 0, output
    line = "warning: drift check resident_memory_mean has no data: the server exposes no "
    assert line + "process_resident_memory_bytes on /metrics" in output
    assert "Traceback" not in output
    assert "resident_memory_mean" in report["scenario"]["unchecked"]
    assert any("resident_memory_mean has no data" in w for w in report["warnings"])
