"""Admission counts a request from the moment it passes, not from when its stream is first read.

The engine registers a request only once its output stream is first read (after the
response has started), so two requests of a burst admitted before either stream starts
would each see the other's slot as free. These check the serving context's bookkeeping
with an engine stand-in that has a queue and rates and nothing else; the HTTP path is
in ``test_slo_admission.py``.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import pytest
from prometheus_client import CollectorRegistry
from starlette.requests import Request

from plimsoll.runtime.engine.client import EngineClient
from plimsoll.runtime.engine.outputs import RequestOutput
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.serving.errors import APIError
from plimsoll.runtime.serving.metrics import ServerMetrics
from plimsoll.runtime.serving.requests import ServingContext
from plimsoll.runtime.serving.settings import ServerSettings
from plimsoll.runtime.serving.slo_admission import check_predicted_ttft, refuse_before_tokenising
from plimsoll.ttft_prediction import SLO_TTFT_HEADER, QueueSnapshot, ServiceRates


class QueueOnlyEngine:
    """One slot, 0.1 s decode steps, an empty queue; ``generate`` records that it was reached."""

    max_model_len = 512

    def __init__(self) -> None:
        self.generated: list[str] = []

    def queue_snapshot(self) -> QueueSnapshot:
        return QueueSnapshot()

    def service_rates(self) -> ServiceRates:
        return ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.1, max_num_seqs=1)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *a: object, **k: object) -> AsyncIterator[RequestOutput]:  # fmt: skip
        self.generated.append(request_id)
        if False:  # an async generator that ends at once: the stream's first read is all this needs
            yield


def _context(engine: QueueOnlyEngine) -> ServingContext:
    settings = ServerSettings(served_model_name="m")
    metrics = ServerMetrics("m", registry=CollectorRegistry())
    return ServingContext(engine=cast(EngineClient, engine), settings=settings, metrics=metrics)


def _request(bound_ms: int) -> Request:
    headers = [(SLO_TTFT_HEADER.encode(), str(bound_ms).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


def test_an_admitted_request_counts_as_waiting_until_its_stream_starts() -> None:
    engine = QueueOnlyEngine()
    ctx = _context(engine)
    adm = ctx.admit("cmpl", num_seqs=2)
    ctx.outputs([1] * 10, SamplingParams(max_tokens=20, n=2), f"{adm.request_id}-0", "completions")
    assert ctx.queue_snapshot().waiting == ((10, 20), (10, 20))

    adm.release()  # ended before its stream was read (the client left): nothing stays counted
    assert ctx.queue_snapshot().waiting == ()
    assert engine.generated == []


def test_the_engine_takes_over_the_count_when_the_stream_is_first_read() -> None:
    engine = QueueOnlyEngine()
    ctx = _context(engine)
    adm = ctx.admit("cmpl")
    stream = ctx.outputs([1] * 10, SamplingParams(max_tokens=20), adm.request_id, "chat")

    async def read() -> None:
        async for _ in stream:
            pass

    asyncio.run(read())
    assert engine.generated == [adm.request_id]
    assert ctx.queue_snapshot().waiting == ()


def test_a_burst_second_request_is_refused_while_the_first_has_not_started() -> None:
    """One slot, 20 tokens of 0.1 s each ahead: a 1 s bound admits the first request and refuses the second."""
    ctx = _context(QueueOnlyEngine())
    assert check_predicted_ttft(ctx, _request(1000), [10], 1) is not None
    adm = ctx.admit("cmpl")
    ctx.outputs([1] * 10, SamplingParams(max_tokens=20), f"{adm.request_id}-0", "completions")

    with pytest.raises(APIError) as refused:
        check_predicted_ttft(ctx, _request(1000), [10], 1)
    assert refused.value.status == 429
    assert "Retry-After" in refused.value.headers

    adm.release()
    assert check_predicted_ttft(ctx, _request(1000), [10], 1) is not None


def test_a_refusal_certain_for_any_prompt_is_made_before_tokenising() -> None:
    """With 2 s of decode ahead on the one slot, a 1 s bound fails whatever the prompt; a 5 s bound may not."""
    ctx = _context(QueueOnlyEngine())
    adm = ctx.admit("cmpl")
    ctx.outputs([1] * 10, SamplingParams(max_tokens=20), adm.request_id, "chat")
    with pytest.raises(APIError) as refused:
        refuse_before_tokenising(ctx, _request(1000), 1)
    assert refused.value.status == 429
    refuse_before_tokenising(ctx, _request(5000), 1)
    adm.release()


def test_a_prompt_long_enough_to_miss_is_refused_before_tokenising_when_its_length_is_known() -> None:
    """A token-id prompt's length is known before tokenising; a text prompt's is at least its
    characters over the most any tokenizer packs into a token. One admitted request ahead takes the
    slot for 0.11 s; a 1 s bound then allows about 790 prompt tokens (1000 tok/s, a 0.1 s step)."""
    from plimsoll.runtime.serving.protocol import CompletionRequest
    from plimsoll.runtime.serving.request_intake import fewest_prompt_tokens

    ctx = _context(QueueOnlyEngine())
    adm = ctx.admit("cmpl")
    ctx.outputs([1] * 10, SamplingParams(max_tokens=1), adm.request_id, "completions")
    ids = CompletionRequest(model="m", prompt=[1] * 900)
    text = CompletionRequest(model="m", prompt="x" * 900)
    assert fewest_prompt_tokens(ids) == 900 and fewest_prompt_tokens(text) == 900 // 32
    with pytest.raises(APIError) as refused:
        refuse_before_tokenising(ctx, _request(1000), 1, fewest_prompt_tokens(ids))
    assert refused.value.status == 429
    refuse_before_tokenising(ctx, _request(1000), 1, fewest_prompt_tokens(text))
    refuse_before_tokenising(ctx, _request(1000), 1, 100)
    adm.release()
