"""`plan` asks for a unit, notices a report of another model, and says when it ignores latency."""

import json
from pathlib import Path

from typer.testing import CliRunner

from plimsoll.cli import app

QWEN = Path(__file__).resolve().parents[2] / "examples" / "model-configs" / "qwen2.5-7b.json"


def report_of(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({
        "schema_version": "1.0", "server": {"model": model, "url": "http://127.0.0.1:8000"},
        "knees": {"throughput": {"concurrency": 8}, "latency": {"concurrency": 4}},
        "recommendation": {"concurrency_per_replica": 3},
    }))  # fmt: skip
    return path


def test_gpu_memory_without_a_unit_is_refused_in_one_line() -> None:
    result = CliRunner().invoke(app, ["plan", "--model-config", str(QWEN), "--gpu-memory", "80"])
    assert result.exit_code == 2
    assert result.output.strip() == "plimsoll plan: --gpu-memory 80 has no unit; write 80GiB or 80GB"


def test_a_report_of_another_model_warns_loudly(tmp_path: Path) -> None:
    args = ["plan", "--model-config", str(QWEN), "--gpu-memory", "80GiB", "--target-concurrency", "10"]
    result = CliRunner().invoke(app, [*args, "--report", str(report_of(tmp_path, "smollm2-135m"))])
    assert result.exit_code == 0, result.output
    warning = [ln for ln in result.output.splitlines() if ln.startswith("plimsoll plan: WARNING: ")]
    assert warning == [
        "plimsoll plan: WARNING: the report measured 'smollm2-135m' but the config is 'qwen2.5-7b' (qwen2); "
        "its per-replica figure holds only for the model it measured: sweep this model, or pass "
        "--concurrency-per-replica"
    ]
    same = CliRunner().invoke(app, [*args, "--report", str(report_of(tmp_path, "Qwen/Qwen2.5-7B-Instruct"))])
    assert same.exit_code == 0 and "WARNING" not in same.output


def test_no_report_says_it_sizes_by_kv_room_alone() -> None:
    args = [
        "plan",
        "--model-config",
        str(QWEN),
        "--gpu-memory",
        "80GiB",
        "--target-concurrency",
        "10",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    notes = [s["how"] for s in json.loads(result.output)["steps"] if s["name"] == "note"]
    assert any(n.startswith("sized by KV room alone, ignoring latency") for n in notes)
