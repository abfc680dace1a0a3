"""A sweep says how big it is, shows level n/N with an ETA, and Ctrl-C keeps the finished levels."""

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from plimsoll.bench.config import BenchConfig
from plimsoll.bench.progress import Live, plan_line
from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.cli import app


def test_help_shows_the_requests_per_level_default() -> None:
    result = CliRunner().invoke(app, ["bench", "sweep", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "(default: max(100, 4 × concurrency)" in result.output


def test_plan_line_counts_every_request_of_the_readme_sweep() -> None:
    cfg = BenchConfig(url="http://127.0.0.1:1", levels=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64))
    # measured max(100, 4c) plus c warm-up per level
    total = sum(max(100, 4 * c) + c for c in cfg.levels)
    assert plan_line(cfg, "sweep") == (
        f"bench sweep: 10 level(s) c=1..64, {total} requests in all (warm-up included; "
        "--requests-per-level sets the count); Ctrl-C stops and writes a partial report"
    )


def test_terminal_progress_shows_level_n_of_total_with_counts_and_time_left() -> None:
    cfg = BenchConfig(url="http://127.0.0.1:1", levels=(1, 2), requests_per_level=10)
    buf = io.StringIO()
    live = Live(cfg, Console(file=buf, force_terminal=True, width=120))
    live.tty = True  # the test's stderr is not a terminal; the console above is
    with live.running():
        update = live.start("c=2", 0)
        update(5, 1)
    text = buf.getvalue()
    assert "level 1/2 c=2, 1 failed" in text
    assert "5/12" in text  # 10 measured + 2 warm-up
    assert "5/23" in text  # both levels: 11 + 12
    assert "left" in text


def test_ctrl_c_writes_a_partial_report_and_says_where(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with running_simulator(ServiceCurve(batch_cap=1, step_t0_s=0.05)) as url:
        cmd = [sys.executable, "-c", "from plimsoll.cli import main; main()", "bench", "sweep", "--url", url]
        cmd += [
            "--levels",
            "1,64",
            "--requests-per-level",
            "3",
            "--input-tokens",
            "8",
            "--output-tokens",
            "4",
        ]
        cmd += ["--max-client-lag-ms", "1000", "--output", str(out)]
        # One request at a time: c=1 takes 4 requests, c=64 takes 128 (64 warm-up), so it is interrupted.
        env = dict(os.environ)
        # A suite started in the background by a non-interactive shell ignores SIGINT, and a child
        # inherits that (Python then installs no Ctrl-C handler): give the sweep a terminal's default.
        proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("level 2/2 c=64: running"):
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    lines.append(rest)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert (
        f"interrupted after 1 of 2 levels: wrote partial report {out} "
        '(marked "partial": true; rerun the missing levels with --levels)'
    ) in stderr
    report = json.loads(out.read_text())
    assert report["partial"] is True
    assert [lv["concurrency"] for lv in report["levels"]] == [1]
    assert any(w.startswith("partial: interrupted before levels 64") for w in report["warnings"])
