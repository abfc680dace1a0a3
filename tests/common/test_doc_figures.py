"""Figures the docs quote, rendered from the code that computes them and looked up in the docs.

A figure in prose drifts when the code changes (the docs once gave SmolLM2's KV bytes per
token for 20 layers instead of 30). Each check here renders the sentence or table from the
code, with whitespace normalised, and fails with the text the docs should carry.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from plimsoll.plan import Step, make_plan, memory_size, parameter_count, read_model_config
from plimsoll.plan import kv_bytes_per_token_per_gpu as plan_kv_bytes
from plimsoll.runtime.engine.model_runner import kv_bytes_per_token as engine_kv_bytes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "model-configs"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _assert_in_doc(doc: str, rendered: str) -> None:
    text = (ROOT / doc).read_text()
    assert _flat(rendered) in _flat(text), f"{doc} should say (rendered from the code):\n{rendered}"


def _plan_table(steps: list[Step]) -> str:
    rows = ["| quantity | value | arithmetic |", "|---|---|---|"]
    for step in steps:
        how, _, result = step.how.rpartition(" = ")
        value = result if how else f"{step.value:,}"
        rows.append(f"| {step.name} | {value} | {how or step.how} |")
    return "\n".join(rows)


def test_smollm2_int8_kv_bytes_per_token_in_quantization_docs() -> None:
    dims = read_model_config(CONFIGS / "smollm2-135m.json")
    int8, fp32 = plan_kv_bytes(dims, 1, "int8"), plan_kv_bytes(dims, 1, "fp32")
    # The engine's own formula (what it allocates) agrees with the planner's.
    hf = LlamaConfig(**{k: v for k, v in json.loads((CONFIGS / "smollm2-135m.json").read_text()).items()})
    assert engine_kv_bytes(hf, torch.float32, "int8") == int8
    assert engine_kv_bytes(hf, torch.float32) == fp32
    _assert_in_doc(
        "docs/quantization.md",
        f"SmolLM2 (head_dim {dims.head_dim}): {int(int8):,} B against {int(fp32):,} B in float32, "
        f"{fp32 / int8:.2f}× more tokens per byte ({dims.layers} layers, {dims.kv_heads} KV heads",
    )
    assert parameter_count(dims) == 134_515_008  # SmolLM2-135M's published count: the config is right


@pytest.mark.parametrize("kv_heads", [None, 32], ids=["gqa", "mha"])
def test_mistral_plan_in_autoscaling_docs(kv_heads: int | None) -> None:
    dims = read_model_config(CONFIGS / "mistral-7b.json")
    steps = make_plan(dims, gpu_memory=memory_size("80GiB"))
    if kv_heads is None:
        _assert_in_doc("docs/autoscaling.md", _plan_table(steps))
        return
    mha = make_plan(dataclasses.replace(dims, kv_heads=kv_heads), gpu_memory=memory_size("80GiB"))
    value = {s.name: s.value for s in mha}
    gqa = {s.name: s.value for s in steps}
    _assert_in_doc(
        "docs/autoscaling.md",
        f"The same dimensions with plain multi-head attention ({kv_heads} KV heads, so also larger "
        f"k/v projections: {value['parameters'] / 1e9:.2f} B parameters) need "
        f"{value['KV bytes per token'] / gqa['KV bytes per token']:g}× the KV per token "
        f"({value['KV bytes per token']:,} B) and fit {value['sequences at full context']} sequences at "
        f"4,096 tokens instead of {gqa['sequences at full context']}.",
    )
