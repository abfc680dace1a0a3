"""The CPU execution plan (``models/cpu_plan.py``): chosen once at load, said in one line, recorded per step.

On tiny random models: the plan follows its switches and row limits (the fused step, the glued
layers, the small-batch matmul's rows on every projection) and its one start-up line names
what serves decode, prefill, attention and the head, with the kernels' build; with the kernels
off, every step is the module path and the line says why; on a GPU device it names the GPU's
kernels and leaves the model alone. The engine logs that line once at load, as a warning only
where the kernels would serve but cannot.
"""

import logging
from typing import Any

import pytest
import torch
from kernel_builds import RUNNABLE, needs_kernels
from tiny_models import tiny_config

from plimsoll.runtime.kernels import cpu_kernels, cpu_library
from plimsoll.runtime.models.cpu_plan import CPUOptions, CPUPlan, RowLimits
from plimsoll.runtime.models.dense import Linear
from plimsoll.runtime.models.llama import LlamaForCausalLM

pytestmark = needs_kernels


def tiny(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config("llama")).eval().to(dtype)


def kernel_rows(model: LlamaForCausalLM) -> set[int]:
    return {m.kernel_rows for m in model.modules() if isinstance(m, Linear)}


def test_a_float32_plan_names_each_path_and_sets_every_projection() -> None:
    model = tiny()
    plan = CPUPlan(model)
    rows = RowLimits()
    assert model.cpu_plan is plan and kernel_rows(model) == {rows.small_matmul}
    line = plan.describe()
    print(line)
    assert line.startswith(f"kernels: the {RUNNABLE[0]} C++ build on ")
    assert f"decode of up to {rows.fused_panels} rows: the fused decode step over column panels" in line
    assert f"other steps of {rows.glued_min} rows or more: glued layers (column panels matmuls" in line
    assert f"smaller steps: layer by layer (small-batch matmul kernel up to {rows.small_matmul} rows" in line
    assert "attention: C++ paged decode-attention kernel" in line and "head: column panels" in line
    assert "\n" not in line and "oneDNN for decode" not in line


def test_switches_and_limits_change_the_plan_and_its_line() -> None:
    model = tiny()
    plan = CPUPlan(model, CPUOptions(fused_decode=False, packed_weights=False, rows=RowLimits(glued_min=9)))
    assert plan.fused is not None and plan.fused.max_rows == 0 and not plan.fused.panels
    assert plan.glued is not None and plan.glued.min_rows == 9 and not plan.glued.panels
    line = plan.describe()
    assert "no fused decode step (off: cpu_fused_decode=False)" in line
    assert "every step of 9 rows or more: glued layers (oneDNN matmuls" in line
    plain = CPUPlan(model, CPUOptions(glued_layers=False, packed_weights=False))
    assert plain.glued is None and plain.fused is not None and plain.fused.max_rows == RowLimits().fused_plain
    assert "no glued layers (off: cpu_glued_layers=False)" in plain.describe()


def test_without_the_kernels_every_step_is_the_module_path_and_the_line_says_why() -> None:
    try:
        cpu_kernels.select("off")
        model = tiny()
        plan = CPUPlan(model)
        assert kernel_rows(model) == {0}
        assert plan.fused is not None and "the CPU kernels: off (--cpu-kernels off)" in str(plan.fused.reason)
        assert plan.describe() == (
            "kernels: torch only on CPU (float32), every step layer by layer; the C++ kernels are off (--cpu-kernels off)"
        )
    finally:
        cpu_kernels.select()


def test_a_bfloat16_plan_names_what_its_cpu_offers() -> None:
    model = tiny(torch.bfloat16)
    plan = CPUPlan(model)
    assert kernel_rows(model) == {RowLimits().bf16_matmul}
    line = plan.describe()
    assert "no fused decode step (torch.bfloat16 weights on cpu)" in line
    if plan.glued is not None and plan.glued.reason is None:  # oneDNN has native bf16 matmuls here
        assert "every step: glued layers (oneDNN bf16 matmuls, C++ glue between)" in line
    else:
        assert "no native bfloat16 matmul" in line and "every step: layer by layer" in line
    assert f"head: small-batch matmul kernel up to {RowLimits().bf16_matmul} rows" in line


def test_a_gpu_plan_only_names_the_gpus_kernels() -> None:
    model = tiny()
    plan = CPUPlan(model, device="cuda", attention_backend="triton")
    assert model.cpu_plan is None and plan.fused is None and kernel_rows(model) == {0}
    assert plan.describe() == "kernels: triton attention on cuda, float32; the CPU C++ kernels are not used"


def engine_lines(caplog: pytest.LogCaptureFixture, model_dir: Any, **config: Any) -> list[logging.LogRecord]:
    from plimsoll.runtime import LLM

    with caplog.at_level("INFO", logger="plimsoll.runtime.engine.llm_engine"):
        LLM(model=str(model_dir), kv_cache_memory=4 << 20, max_model_len=128, **config)
    return [r for r in caplog.records if r.getMessage().startswith("kernels:")]


def test_the_engine_logs_its_plan_once(
    tiny_model_dir: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (line,) = engine_lines(caplog, tiny_model_dir("llama"))
    assert line.levelno == logging.INFO and "fused decode step" in line.getMessage()
    caplog.clear()
    (line,) = engine_lines(caplog, tiny_model_dir("llama"), cpu_kernels="off")  # asked for: not a warning
    assert line.levelno == logging.INFO and "torch only" in line.getMessage()
    caplog.clear()

    def unloadable(name: str) -> None:
        raise cpu_library.KernelsUnavailable(f"libplimsoll_cpu_{name}.so is not installed")

    monkeypatch.setattr(cpu_library, "load", unloadable)
    (line,) = engine_lines(caplog, tiny_model_dir("llama"))
    assert line.levelno == logging.WARNING and "is not installed" in line.getMessage()


def test_a_plan_steps_aside_while_the_process_runs_another_build() -> None:
    # Another engine in the process selected another build: this plan's panels are laid out for
    # its own, so its steps and head go to the module path until its build is back.
    if len(RUNNABLE) < 2:
        pytest.skip("one build runs on this CPU")
    model = tiny()
    plan = CPUPlan(model)
    hidden = torch.randn(3, model.config.hidden_size)
    head = plan.fused.head if plan.fused is not None else None
    assert head is not None and plan.logits(hidden) is not None
    try:
        other = cpu_kernels.select(RUNNABLE[-1]).library
        assert other is not None and other is not plan.kernels
        assert plan.logits(hidden) is None
        if other.plimsoll_packed_f32_panel_cols() != head.cols:
            with pytest.raises(ValueError, match=f"panels of {head.cols} columns"):
                cpu_kernels.packed_linear(hidden, head)
    finally:
        cpu_kernels.select()
    torch.testing.assert_close(
        plan.logits(hidden),
        hidden @ model.model.embed_tokens.weight.T
        if model.tie_word_embeddings
        else hidden @ model.lm_head.weight.T,
        rtol=1e-4,
        atol=1e-4,
    )
