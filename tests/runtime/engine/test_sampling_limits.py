"""One table of sampling limits: the HTTP models and ``SamplingParams.validate`` accept and
refuse the same values, because both read ``sampling_params.LIMITS``."""

from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.runtime.engine.sampling_params import LIMITS, SamplingParams
from plimsoll.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest

SHARED = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "max_tokens", "min_tokens", "logprobs", "seed"]  # fmt: skip
INTEGERS = {"n", "top_k", "max_tokens", "min_tokens", "logprobs", "seed"}


def edges(name: str) -> tuple[list[Any], list[Any]]:
    """Values at the bounds (accepted) and just past them (refused)."""
    lo, hi = LIMITS[name].ge, LIMITS[name].le if LIMITS[name].le is not None else LIMITS[name].lt
    step = 1 if name in INTEGERS else 1e-3
    inside = [lo, hi - (step if LIMITS[name].lt is not None else 0)]
    outside = [lo - step, hi + (0 if LIMITS[name].lt is not None else step)]
    return inside, outside


def http_accepts(name: str, value: Any) -> bool:
    body = {"prompt": "hi", name: value, **({"max_tokens": 2**31 - 1} if name == "min_tokens" else {})}
    try:
        CompletionRequest.model_validate(body)
    except ValidationError as exc:
        assert name in str(exc)
        return False
    return True


def engine_accepts(name: str, value: Any) -> bool:
    try:
        SamplingParams(**{"max_tokens": None, name: value}).validate()
    except ValueError as exc:
        assert name in str(exc)
        return False
    return True


@pytest.mark.parametrize("name", SHARED)
def test_the_http_edge_and_the_engine_share_each_limit(name: str) -> None:
    inside, outside = edges(name)
    for value in inside:
        assert http_accepts(name, value) and engine_accepts(name, value), (name, value)
    for value in outside:
        assert not http_accepts(name, value) and not engine_accepts(name, value), (name, value)


def test_chat_token_budgets_share_the_max_tokens_limit() -> None:
    hi = LIMITS["max_tokens"].le
    assert hi is not None
    for field in ("max_tokens", "max_completion_tokens"):
        for value, ok in ((1, True), (hi, True), (0, False), (hi + 1, False)):
            body = {"messages": [{"role": "user", "content": "hi"}], field: value}
            try:
                ChatCompletionRequest.model_validate(body)
                accepted = True
            except ValidationError as exc:
                assert field in str(exc)
                accepted = False
            assert accepted is ok, (field, value)


def test_logit_bias_values_share_their_limit() -> None:
    limit = LIMITS["logit_bias"]
    assert limit.ge is not None and limit.le is not None
    for value, ok in ((limit.le, True), (limit.ge, True), (limit.le + 0.5, False), (limit.ge - 0.5, False)):
        assert http_accepts("logit_bias", {"7": value}) is ok
        assert engine_accepts("logit_bias", {7: value}) is ok
