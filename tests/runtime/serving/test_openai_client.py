"""The official `openai` client, unchanged, against the real server and engine (tiny model)."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401  (fixture)

from plimsoll.runtime.testing import ThreadedServer

API_KEY = "sk-plimsoll-test"
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def keyed_server(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, server={"api_key": API_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(keyed_server: ThreadedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client: openai.OpenAI, keyed_server: ThreadedServer) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [keyed_server.engine.model_name]


def test_completion_reports_usage_and_finish_reason(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="hello", max_tokens=7, extra_body=NO_EOS, **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(b"hello")  # byte-level tokenizer, no BOS added
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_greedy_is_deterministic_and_streaming_matches(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="The plimsoll line", max_tokens=12, extra_body=NO_EOS, **GREEDY)
    a = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    b = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    assert a == b
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_seed_makes_sampling_reproducible_and_n2_gives_two_choices(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="seeded", max_tokens=10, n=2, temperature=1.0, extra_body=NO_EOS)
    a = client.completions.create(seed=1234, **kw)  # type: ignore[call-overload]
    b = client.completions.create(seed=1234, **kw)  # type: ignore[call-overload]
    c = client.completions.create(seed=4321, **kw)  # type: ignore[call-overload]
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert a.usage is not None and a.usage.completion_tokens == 20  # both choices count


def test_stop_string_cuts_the_text_before_it(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="stop here", max_tokens=24, extra_body=NO_EOS, **GREEDY)
    full = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    # Pick a printable ASCII character from the middle of the greedy text as the stop string.
    candidates = [
        i for i, ch in enumerate(full) if i >= 2 and ch.isascii() and ch.isprintable() and ch != " "
    ]
    assert candidates, f"greedy text has no printable ASCII to stop on: {full!r}"
    stop = full[candidates[0]]
    cut = client.completions.create(stop=[stop], **kw).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    assert stop not in cut.text


def test_echo_and_several_prompts_in_one_request(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt="echo me", max_tokens=3, echo=True, extra_body=NO_EOS, **GREEDY
    )
    assert out.choices[0].text.startswith("echo me")
    batch = client.completions.create(
        model=model, prompt=["first", "second"], n=2, max_tokens=2, extra_body=NO_EOS
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]  # prompt i, choice k -> i * n + k
    assert batch.usage is not None and batch.usage.prompt_tokens == len("first") + len("second")
    assert batch.usage.completion_tokens == 8


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt="logprobs", max_tokens=6, logprobs=3, extra_body=NO_EOS, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs is not None
        and lp.top_logprobs is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen is not None and chosen <= 0.0
        assert 1 <= len(top) <= 3
        # Greedy picks the best token. (Byte tokens that decode to the same "�" share one
        # key in the legacy dict format, so compare by value, not by key.)
        assert chosen >= max(top.values()) - 1e-5
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_non_streaming_and_streaming_agree(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    kw = dict(model=model, messages=messages, max_tokens=9, extra_body=NO_EOS, **GREEDY)
    full = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.completion_tokens == 9
    stream = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]
    assert stream[0].choices[0].delta.role == "assistant" and stream[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert stream[-1].usage is not None and stream[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n2_logprobs_and_top_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "two"}],
        n=2,
        max_tokens=5,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5
        for tok in choice.logprobs.content:
            assert len(tok.top_logprobs) == 2
            assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
            assert tok.logprob <= tok.top_logprobs[0].logprob + 1e-6


def test_chat_streaming_n2_sends_a_role_chunk_per_choice(client: openai.OpenAI, model: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            n=2,
            max_tokens=4,
            stream=True,
            extra_body=NO_EOS,
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    finished = sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason)
    assert finished == [0, 1]


async def test_async_client_concurrent_streams_and_completions(
    keyed_server: ThreadedServer, model: str
) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0
    ) as aclient:

        async def one_stream(i: int) -> str:
            stream = await aclient.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"q{i}"}],
                max_tokens=6,
                stream=True,
                temperature=0,
                extra_body=NO_EOS,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def one_full(i: int) -> str:
            out = await aclient.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"q{i}"}],
                max_tokens=6,
                temperature=0,
                extra_body=NO_EOS,
            )
            return out.choices[0].message.content or ""

        streamed = await asyncio.gather(*(one_stream(i) for i in range(4)))
        full = await asyncio.gather(*(one_full(i) for i in range(4)))
        assert streamed == full  # batching with other requests does not change greedy output
        comp = await aclient.completions.create(model=model, prompt="async", max_tokens=3, extra_body=NO_EOS)
        assert comp.usage is not None and comp.usage.completion_tokens == 3


def test_wrong_or_missing_api_key_is_401(keyed_server: ThreadedServer, model: str) -> None:
    with (
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError) as err,
    ):
        bad.completions.create(model=model, prompt="x", max_tokens=1)
    assert err.value.status_code == 401
    r = httpx.post(f"{keyed_server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    # Probes and metrics stay open for the kubelet and Prometheus.
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.url}/metrics").status_code == 200
