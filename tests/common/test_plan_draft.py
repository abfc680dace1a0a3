"""`plimsoll plan --draft-model-config`: a speculative draft model's weights and KV cache are counted."""

import json
from pathlib import Path

from typer.testing import CliRunner

from plimsoll.cli import app
from plimsoll.plan import (
    kv_bytes_per_token_per_gpu,
    make_plan,
    memory_size,
    read_model_config,
    weight_bytes_per_gpu,
)

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "model-configs"
TARGET, DRAFT = CONFIGS / "qwen2.5-7b.json", CONFIGS / "smollm2-135m.json"


def _values(steps: list) -> dict:
    return {s.name: s.value for s in steps}


def test_the_draft_takes_weights_and_kv_from_the_budget() -> None:
    target, draft = read_model_config(TARGET), read_model_config(DRAFT)
    alone = _values(make_plan(target, gpu_memory=memory_size("80GiB")))
    both = _values(make_plan(target, gpu_memory=memory_size("80GiB"), draft=draft))
    assert both["draft weight bytes"] == weight_bytes_per_gpu(draft, 1, "bf16")
    assert both["KV budget"] == alone["KV budget"] - both["draft weight bytes"]
    assert both["KV bytes per token"] == alone["KV bytes per token"] + kv_bytes_per_token_per_gpu(
        draft, 1, "bf16"
    )
    assert both["KV bytes per token"] == 57_344 + 23_040  # 2·28·4·128·2 + 2·30·3·64·2
    assert both["sequences at full context"] < alone["sequences at full context"]


def test_a_draft_whose_heads_do_not_split_stays_whole_on_each_gpu() -> None:
    # SmolLM2 has 3 KV heads and 9 query heads: tensor parallel 4 cannot split them, so each GPU holds all of it.
    both = make_plan(read_model_config(TARGET), gpu_memory=memory_size("80GiB"), gpus_per_replica=4,
                     draft=read_model_config(DRAFT))  # fmt: skip
    draft_step = next(s for s in both if s.name == "draft weight bytes")
    assert "not split" in draft_step.how
    assert draft_step.value == weight_bytes_per_gpu(read_model_config(DRAFT), 1, "bf16")


def test_cli_json_names_the_draft_step() -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model-config",
            str(TARGET),
            "--gpu-memory",
            "80GiB",
            "--draft-model-config",
            str(DRAFT),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    steps = {s["name"]: s for s in json.loads(result.output)["steps"]}
    assert steps["KV bytes per token"]["value"] == 80_384
    assert "each token sits in both caches" in steps["KV bytes per token"]["how"]
