"""The start-up int8 speed check (engine/int8_speed.py): what it logs; the timing itself needs CUDA."""

import logging
from typing import Any

import pytest

from plimsoll.runtime.engine import int8_speed


def test_a_slower_int8_path_is_a_warning_and_a_faster_one_is_not(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=int8_speed.log.name):
        slow = int8_speed._say("--quantization int8", 2.0, 1.0)
        fast = int8_speed._say("--kv-cache-dtype int8", 0.5, 1.0)
    assert slow == {"int8_ms": 2.0, "bf16_ms": 1.0, "ratio": 2.0} and fast["ratio"] == 0.5
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "2.00x slower than bfloat16" in warned[0].getMessage()


def test_nothing_is_timed_off_cuda(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM

    llm = LLM(
        model=str(tiny_model_dir("llama")), kv_cache_memory="1MiB", max_model_len=64, quantization="int8"
    )
    assert int8_speed.check(llm.engine.runner.model, "int8", "int8", "triton", 8) == {}
    assert not hasattr(llm.engine, "int8_speed")  # the engine asks only on CUDA
