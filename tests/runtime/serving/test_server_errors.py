"""Bad input gets its status code and an OpenAI-shaped error; random bodies never cause a 5xx."""

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import chat_model_dir, metric, scrape, server  # noqa: F401  (fixtures)

from plimsoll import metric_names as mn
from plimsoll.runtime.testing import ThreadedServer

MAX_MODEL_LEN = 256  # server_fixtures.ENGINE_ARGS


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_error(
    r: httpx.Response, status: int, param: str | None = None, says: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["type"], str) and err["type"]
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    if param is not None:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err["message"]
    return err


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

BAD_BODIES = [
    # (path, body, status, param, message fragment)
    (COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    (COMP, {"prompt": "x", "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than or equal to"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (COMP, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
    (COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs", "20"),
    (COMP, {"prompt": "x", "stream": [1]}, 400, "stream", None),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop", "must not be empty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (COMP, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, None, "min_tokens"),
    (COMP, {}, 400, "prompt", "Field required"),
    (COMP, {"prompt": []}, 400, "prompt", "empty"),
    (COMP, {"prompt": [5, 999999]}, 400, "prompt", "vocabulary"),
    (COMP, {"prompt": "x" * (MAX_MODEL_LEN + 10)}, 400, "prompt", "maximum context length"),
    (COMP, {"prompt": "x" * 200, "max_tokens": 100}, 400, "max_tokens", "Lower max_tokens"),
    (COMP, {"prompt": "x", "model": "no-such-model"}, 404, "model", "does not exist"),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None, "role"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, 400, None, "logprobs=true"),
    (CHAT, {"messages": USER, "max_tokens": 10_000}, 400, "max_tokens", "maximum context length"),
    (CHAT, {"messages": [{"role": "user", "content": "y" * 300}]}, 400, "messages", "maximum context length"),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "says"), BAD_BODIES)
def test_bad_input_gets_its_status_and_openai_error(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None, says: str | None
) -> None:
    assert_error(http.post(path, json=body), status, param, says)


def test_malformed_json_and_non_objects_are_400(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    err = assert_error(http.post(COMP, content=b'{"prompt": "x",', headers=headers), 400)
    assert "JSON" in err["message"]
    assert_error(http.post(COMP, content=b"[1, 2]", headers=headers), 400, says="JSON object")
    assert_error(http.post(COMP, content=b"\xff\xfe", headers=headers), 400)
    assert_error(http.post(CHAT, content=b"", headers=headers), 400)


def test_unknown_route_and_method_keep_the_error_shape(http: httpx.Client) -> None:
    assert_error(http.post("/v1/nope", json={}), 404)
    assert_error(http.get(COMP), 405)


# ---- fuzz -------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from([-1, 0, 1, 2, 3, 20, 21, 256, 10**9]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
# Plausible values per field, mostly in range, so a good share of bodies pass validation and
# reach the engine; `values` (any JSON) and edge integers cover wrong types and out-of-range.
small_int = st.integers(-2, 6)


def mostly(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(plausible, plausible, plausible, plausible, values)


FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["nope", ""]) | values,
    "max_tokens": mostly(st.integers(1, 6)) | small_int,
    "n": mostly(st.integers(1, 3)) | st.integers(-1, 0),
    "temperature": mostly(st.floats(0, 2)) | st.floats(-1, 3),
    "top_p": mostly(st.floats(0.01, 1)) | st.floats(-0.5, 1.5),
    "top_k": mostly(st.integers(-1, 300)) | st.integers(-3, -2),
    "min_p": mostly(st.floats(0, 1)) | st.floats(-0.5, 1.5),
    "seed": mostly(st.integers(-(2**63), 2**64 - 1)) | st.integers(-(2**65), 2**65),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.text(min_size=1, max_size=3)),
    "stop_token_ids": mostly(st.lists(st.integers(0, 300), max_size=3))
    | st.lists(st.integers(-1, 0), max_size=2),
    "logprobs": mostly(st.integers(0, 20) | st.booleans()) | st.integers(-1, 22),
    "top_logprobs": mostly(st.integers(0, 20)) | st.integers(-1, 22),
    "presence_penalty": mostly(st.floats(-2, 2)) | st.floats(-3, 3),
    "frequency_penalty": mostly(st.floats(-2, 2)) | st.floats(-3, 3),
    "repetition_penalty": mostly(st.floats(0.01, 2)) | st.floats(-1, 3),
    "min_tokens": mostly(st.integers(0, 3)) | st.integers(-1, 8),
    "ignore_eos": mostly(st.booleans()),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        )
    ),
    "echo": mostly(st.booleans()),
    "best_of": mostly(st.integers(1, 3)) | st.integers(-1, 0),
}
prompts = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(0, 258), min_size=1, max_size=6),
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 258), min_size=1, max_size=4), min_size=1, max_size=2),
    st.lists(st.integers(-5, 300), max_size=6),
    values,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}
) | st.fixed_dictionaries({"role": values, "content": values})
messages = mostly(st.lists(message, min_size=1, max_size=2)) | st.lists(message, max_size=0)


@st.composite
def random_request(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {}
    if draw(st.integers(0, 9)) > 0:  # usually present, sometimes missing
        body["messages" if chat else "prompt"] = draw(messages if chat else prompts)
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[key] = draw(FIELDS[key])
    # Keep generation short enough for a few hundred bodies: the fuzz is about input, not length.
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 6:
        body["max_tokens"] = draw(st.integers(1, 6))
    raw = json.dumps(body).encode()
    mangle = draw(st.integers(0, 29))  # hypothesis leans to 0, so the rare cases sit at the top
    if mangle == 29:
        raw = raw[: draw(st.integers(0, len(raw)))]  # truncated JSON
    elif mangle == 28:
        raw = draw(st.binary(max_size=30))
    return (CHAT if chat else COMP), raw


@pytest.mark.slow
def test_fuzzed_bodies_never_cause_a_server_error(server: ThreadedServer, http: httpx.Client) -> None:  # noqa: F811
    seen: dict[int, int] = {}

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(random_request())
    def check(req: tuple[str, bytes]) -> None:
        path, raw = req
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, raw, r.status_code, r.text)
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            events = [line for line in r.text.split("\n\n") if line]
            assert events[-1] == "data: [DONE]"
            for e in events[:-1]:
                assert "error" not in json.loads(e.removeprefix("data: ")), e
        elif r.status_code == 200:
            assert r.json()["usage"]["total_tokens"] >= 1
        else:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    # The fuzz has to reach the engine, not just the validator.
    assert seen.get(200, 0) >= 30 and seen.get(400, 0) >= 30, seen
    # Afterwards the server still answers correctly and nothing is left holding KV blocks.
    ok = http.post(
        COMP, json={"prompt": "still alive", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = scrape(server.url)
        if metric(s, mn.NUM_REQUESTS_RUNNING) == 0 and metric(s, mn.KV_CACHE_USAGE_RATIO) == 0:
            break
        time.sleep(0.1)
    assert metric(s, mn.NUM_REQUESTS_RUNNING) == 0 and metric(s, mn.NUM_REQUESTS_WAITING) == 0
    assert metric(s, mn.KV_CACHE_USAGE_RATIO) == 0.0
    assert server.ctx.num_in_flight == 0
