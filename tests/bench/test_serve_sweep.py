"""Must-show 4: a sweep against a real `plimsoll serve` (tiny random model on CPU) yields a recommendation."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plimsoll.cli import app


@pytest.mark.slow
def test_sweep_against_plimsoll_serve_recommends_a_concurrency(tmp_path: Path) -> None:
    from plimsoll.runtime.testing import ServerProcess, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "serve-sweep.json"
    # A batch cap of 2 puts the saturation point inside the tested levels.
    with ServerProcess(["--model", str(model), "--max-num-seqs", "2"], startup_timeout=300) as server:
        result = CliRunner().invoke(
            app,
            [
                "bench",
                "sweep",
                "--url",
                server.url,
                "--levels",
                "1,2,4,8",
                "--input-tokens",
                "32",
                "--output-tokens",
                "16",
                "--duration-per-level",
                "1.5",
                "--request-timeout",
                "60",
                # shared CI CPUs: keep the gates, loosen the client-noise ones
                "--max-client-lag-ms",
                "1000",
                "--min-concurrency-ratio",
                "0.8",
                "--output",
                str(out),
            ],
        )
        assert result.exit_code == 0, result.output + server.log()[-3000:]
    report = json.loads(out.read_text())
    assert report["server"]["engine_family"] == "plimsoll"
    assert report["workload"]["token_count"] == "tokenizer"  # the model dir's own tokenizer built the prompts
    valid = [lv for lv in report["levels"] if lv["valid"]]
    assert len(valid) >= 3, [lv["invalid_reasons"] for lv in report["levels"]]
    for lv in valid:
        assert lv["tokens"]["output_mean"] == 16  # ignore_eos honoured
        assert lv["tokens"]["prompt_mean"] == pytest.approx(32, abs=2)
        assert lv["server"]["running"]["max"] <= 2
    assert max(lv["server"]["waiting"]["max"] for lv in valid) >= 1  # beyond the cap requests queue
    rec = report["recommendation"]["concurrency_per_replica"]
    assert isinstance(rec, int) and rec >= 1, report["recommendation"]["reason"]
    assert (out.parent / "serve-sweep.throughput.png").exists()
