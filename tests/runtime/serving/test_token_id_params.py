"""Token ids a client sends: ``logit_bias`` and ``allowed_token_ids`` are served, never dropped;
an id outside the model's vocabulary is refused on every API (completions, chat, token-id
prompts, the offline ``LLM``) before it reaches a kernel, and the server carries on.

Driven through the official ``openai`` client against one in-process server.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401  (fixtures)

from plimsoll.runtime.testing import ThreadedServer

VOCAB = 259  # the tiny model's byte-level vocabulary
MODEL = "tiny"  # the server's --served-model-name


@pytest.fixture(scope="module")
def tok(chat_model_dir: Path) -> Any:  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model_dir))


def token_id(tok: Any, char: str) -> int:
    (tid,) = tok.encode(char, add_special_tokens=False)
    return int(tid)


@pytest.fixture(scope="module")
def client(chat_model_dir: Path) -> Iterator[openai.OpenAI]:  # noqa: F811
    srv: ThreadedServer = start_server(chat_model_dir, served_model_name=MODEL)
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0) as c:
        yield c
    srv.stop()


def greedy_first(client: openai.OpenAI, **extra: Any) -> str:
    out = client.completions.create(model=MODEL, prompt="The cat", max_tokens=1, temperature=0, **extra)
    return out.choices[0].text


def test_logit_bias_changes_the_chosen_token_on_completions_and_chat(client: openai.OpenAI, tok: Any) -> None:
    plain = greedy_first(client)
    q, r = str(token_id(tok, "Q")), str(token_id(tok, "R"))
    assert greedy_first(client, logit_bias={q: 50, r: 60}) == "R" != plain
    assert greedy_first(client, logit_bias={q: 50, r: -100}) == "Q"  # -100 bans R
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.8, seed=3,
        logit_bias={str(token_id(tok, "Z")): 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == "ZZZ"


def test_allowed_token_ids_restrict_sampling(client: openai.OpenAI, tok: Any) -> None:
    allowed = [token_id(tok, c) for c in "ab"]
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=12, temperature=1.0, seed=1,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text and set(out.choices[0].text) <= {"a", "b"}


OUT_OF_RANGE: list[tuple[str, dict[str, Any]]] = [
    ("stop_token_ids", {"extra_body": {"stop_token_ids": [VOCAB], "min_tokens": 2}}),
    ("logit_bias", {"logit_bias": {str(VOCAB + 5): 1.0}}),
    ("allowed_token_ids", {"extra_body": {"allowed_token_ids": [4, VOCAB]}}),
]


@pytest.mark.parametrize(("field", "extra"), OUT_OF_RANGE, ids=[f for f, _ in OUT_OF_RANGE])
def test_out_of_range_ids_are_refused_on_completions_and_chat(
    client: openai.OpenAI, field: str, extra: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as comp:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
        )
    for err in (comp.value, chat.value):
        assert err.status_code == 400 and field in str(err) and "vocabulary" in str(err)
    assert greedy_first(client)  # the server carries on


def test_out_of_range_prompt_ids_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=MODEL, prompt=[5, VOCAB], max_tokens=2)


def test_the_offline_api_refuses_out_of_range_ids(chat_model_dir: Path) -> None:  # noqa: F811
    from plimsoll.runtime import LLM, SamplingParams

    llm = LLM(model=str(chat_model_dir), kv_cache_memory="4MiB", max_model_len=128)
    for field, params in (
        ("stop_token_ids", SamplingParams(stop_token_ids=[VOCAB + 1], min_tokens=2)),
        ("logit_bias", SamplingParams(logit_bias={VOCAB: 2.0})),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[VOCAB * 4])),
    ):
        with pytest.raises(ValueError, match=f"{field}.*vocabulary"):
            llm.generate([[5, 6]], params)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, VOCAB]], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(
        [[5, 6]], SamplingParams(max_tokens=2, logit_bias={70: 100.0}, temperature=0, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == [70, 70]
