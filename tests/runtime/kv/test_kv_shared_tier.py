"""The shared tier against a real Valkey/Redis server: replica A's prefix is replica B's hit.

Two engines (the two replicas) and one real server process on 127.0.0.1. Also: a corrupt or
foreign block in the server is rejected by its check and recomputed (output unchanged), and
killing the server mid-load leaves every request served, each paying at most the one failed
call that opened the circuit.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from plimsoll.runtime.testing import KeyValueServer

PROMPT = 200


@pytest.fixture(scope="module")
def kv_server() -> Iterator[KeyValueServer]:
    with KeyValueServer() as server:
        yield server


def engine(model: Any, url: str, **kw: Any) -> Any:
    from plimsoll.runtime import LLM

    return LLM(model=str(model), kv_cache_memory="160KiB", max_model_len=256, kv_shared_url=url, **kw)


def generate(llm: Any, prompt: list[int]) -> tuple[int, list[int]]:
    from plimsoll.runtime import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    if llm.engine.kv_connector is not None:
        llm.engine.kv_connector.drain()
    return out.metrics.num_cached_tokens, out.outputs[0].token_ids


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(PROMPT)]


def test_prefix_computed_on_a_is_a_hit_on_b(tiny_model_dir: Any, kv_server: KeyValueServer) -> None:
    from plimsoll.runtime import LLM

    model = tiny_model_dir("llama")
    p = prompt(10)
    a, b = engine(model, kv_server.url), engine(model, kv_server.url)
    plain = LLM(model=str(model), kv_cache_memory="160KiB", max_model_len=256)
    try:
        on_a, on_b, recomputed = generate(a, p), generate(b, p), generate(plain, p)
    finally:
        for llm in (a, b, plain):
            llm.close()
    assert on_a[0] == 0 and on_b[0] == (PROMPT - 1) // 16 * 16
    assert on_a[1] == on_b[1] == recomputed[1]
    assert b.engine.kv_connector.counters.hits == {"SHARED": on_b[0]}


def test_corrupt_and_foreign_blocks_are_rejected(tiny_model_dir: Any, kv_server: KeyValueServer) -> None:
    import redis

    model = tiny_model_dir("llama")
    p, q = prompt(11), prompt(12)
    a = engine(model, kv_server.url)
    try:
        truth = generate(a, p)
        generate(a, q)
        identity = a.engine.kv_connector.identity
        block_keys = [identity.key(h) for h in a.engine.scheduler.kv.pool.cached]
    finally:
        a.close()
    client = redis.Redis.from_url(kv_server.url)
    keys_p = [identity.key(h) for h in _chain(p)]
    keys_q = [identity.key(h) for h in _chain(q)]
    stored = {k.decode() for k in client.keys("plimsoll:kv:*")}
    assert set(keys_p) <= stored and set(keys_q) <= stored and block_keys
    # Block 0 of p: flip one payload byte. Block 0 of q: replace with p's block 1 (foreign).
    blob = bytearray(client.get(keys_p[0]))
    blob[-1] ^= 0xFF
    client.set(keys_p[0], bytes(blob))
    client.set(keys_q[0], client.get(keys_p[1]))
    b = engine(model, kv_server.url)
    try:
        corrupt, foreign = generate(b, p), generate(b, q)
        stats = b.engine.kv_connector.shared.stats
    finally:
        b.close()
    assert corrupt == (0, truth[1])  # nothing served past the corrupt block 0: all recomputed, same output
    assert foreign[0] == 0
    assert stats.rejected == 2 and stats.hits == 0


def _chain(tokens: list[int]) -> list[bytes]:
    from plimsoll.runtime.kv.blocks import chain_hashes

    return chain_hashes(tokens[: PROMPT - 1], 16)


def test_server_killed_mid_load_requests_still_succeed(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import SamplingParams

    model = tiny_model_dir("llama")
    with KeyValueServer() as server:
        llm = engine(model, server.url, kv_shared_timeout_s=0.5)
        prompts = [prompt(100 + i) for i in range(12)]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        killed = threading.Event()
        seen = {"n": 0}

        def on_step(stats: Any) -> None:  # the engine's own observer: kill after the first few steps
            seen["n"] += 1
            if seen["n"] == 3 and not killed.is_set():
                server.kill()
                killed.set()

        llm.engine.observer = type("Observer", (), {"on_step": staticmethod(on_step),
                                                     "on_request_finished": staticmethod(lambda o: None)})()  # fmt: skip
        try:
            outs = llm.generate(prompts, params)
            stats = llm.engine.kv_connector.shared.stats
            breaker = llm.engine.kv_connector.shared.breaker
        finally:
            llm.close()
    assert killed.is_set()
    assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in outs)
    # The first failed call opens the circuit: later requests skip the server instead of each paying a timeout.
    # (A call already in flight on the other worker when it died may fail too; none after the circuit opened.)
    assert stats.errors >= 1 and breaker.times_opened >= 1
    assert stats.skipped > 0 and stats.errors < len(prompts)


def test_a_server_with_a_password_serves_the_replica_that_has_it(
    tiny_model_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """requirepass on the server (as the operator's Valkey runs): the password from the config makes
    hits; a replica without it recomputes every request, says why once, and never logs the password."""
    model = tiny_model_dir("llama")
    secret = "s3cret-pw"
    p = prompt(40)
    caplog.set_level("INFO", logger="plimsoll.runtime.kv")
    with KeyValueServer(password=secret) as server:
        a = engine(model, server.url, kv_shared_password=secret)
        b = engine(model, server.url, kv_shared_password=secret)
        stranger = engine(model, server.url)
        try:
            on_a, on_b = generate(a, p), generate(b, p)
            refused = [generate(stranger, prompt(41)), generate(stranger, prompt(42))]
            errors = stranger.engine.kv_connector.shared.stats.errors
        finally:
            for llm in (a, b, stranger):
                llm.close()
    assert on_b[0] > 0 and on_b[1] == on_a[1]  # the password let B read what A wrote
    assert all(cached == 0 and len(tokens) == 6 for cached, tokens in refused)  # served, by recomputing
    assert errors >= 1
    refusals = [r for r in caplog.records if "refused this replica" in r.getMessage()]
    assert len(refusals) == 1 and "PLIMSOLL_KV_SHARED_PASSWORD" in refusals[0].getMessage()
    assert "with a password" in caplog.text and secret not in caplog.text


def test_a_password_in_a_url_is_never_shown() -> None:
    from pydantic import ValidationError

    from plimsoll.runtime.engine.config import EngineConfig
    from plimsoll.runtime.kv.shared_url import redacted_url

    assert redacted_url("redis://:pw@kv:6379/0") == "redis://:***@kv:6379/0"
    assert redacted_url("rediss://user:pw@kv:6380") == "rediss://user:***@kv:6380"
    assert redacted_url("redis://kv:6379/0") == "redis://kv:6379/0"
    config = EngineConfig(model="m", kv_shared_url="redis://kv:6379/0", kv_shared_password="pw")
    assert "pw" not in repr(config) and "pw" not in str(config.model_dump())
    with pytest.raises(ValidationError) as error:
        EngineConfig(model="m", kv_shared_url="http://:pw@kv:6379")
    message = error.value.errors()[0]["msg"]  # what `plimsoll serve` prints (not pydantic's input echo)
    assert "http://:***@kv:6379" in message and "pw@" not in message
