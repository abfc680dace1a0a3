"""`plimsoll bench sweep --models a,b,c`: an even mix of model names per level, and per-model figures.

Against a simulator serving a base model and two LoRA adapters (vLLM's adapter API), through the CLI.
"""

import collections
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.cli import app

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "bench" / "report.schema.json"


@pytest.fixture(scope="module")
def lora_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("adapters")
    modules = []
    for name in ("sql", "fr"):
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
        modules.append(f"{name}={root / name}")
    curve = ServiceCurve(batch_cap=8, step_t0_s=0.01, enable_lora=True, lora_modules=tuple(modules))
    with running_simulator(curve) as url:
        yield url


def args(url: str, *extra: str) -> list[str]:
    return [
        "bench", "sweep", "--url", url, "--levels", "3,6", "--input-tokens", "8", "--output-tokens", "4",
        "--requests-per-level", "30", "--warmup-requests", "0",
        "--max-client-lag-ms", "1000", "--min-concurrency-ratio", "0.5", *extra,
    ]  # fmt: skip


def test_sweep_sends_an_even_mix_and_reports_each_model(lora_sim: str, tmp_path: Path) -> None:
    out = tmp_path / "mix.json"
    result = CliRunner().invoke(app, args(lora_sim, "--models", "sim-model,sql,fr", "--output", str(out)))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    jsonschema.validate(report, json.loads(SCHEMA_FILE.read_text()))
    assert report["server"]["models"] == ["sim-model", "sql", "fr"]
    rows = [json.loads(line) for line in out.with_suffix(".requests.jsonl").read_text().splitlines()]
    for level in (3, 6):
        mix = collections.Counter(r["model"] for r in rows if r["concurrency"] == level and r["measured"])
        assert set(mix) == {"sim-model", "sql", "fr"} and max(mix.values()) - min(mix.values()) <= 1, mix
    for level in report["levels"]:
        by_model = level["by_model"]
        assert list(by_model) == ["sim-model", "sql", "fr"]
        assert sum(m["completed"] for m in by_model.values()) == level["requests"]["completed"]
        assert all(m["failed"] == 0 and m["output_tokens_per_s"] > 0 and m["tpot"] for m in by_model.values())
    assert "c=3 per model: sim-model" in result.output


def test_models_the_server_does_not_serve_are_refused_before_the_sweep(lora_sim: str) -> None:
    result = CliRunner().invoke(app, args(lora_sim, "--models", "sim-model,nope"))
    assert result.exit_code != 0
    assert "does not serve ['nope']" in result.output
    one = CliRunner().invoke(app, args(lora_sim, "--models", "sql"))
    assert one.exit_code == 2 and "two or more" in one.output
    both = CliRunner().invoke(app, args(lora_sim, "--models", "sql,fr", "--model", "sql"))
    assert both.exit_code == 2 and "not both" in both.output
