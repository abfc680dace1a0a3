"""Tenants do not share the prefix cache: the tenant header and vLLM's ``cache_salt`` start the hash chain.

A prompt cached for one tenant is a miss (``cached_tokens`` 0) for another, a hit for
the same tenant; ``cached_tokens`` itself is reported only with ``--enable-prompt-tokens-details``.
"""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401  (fixture)

from plimsoll.objectives import FAIRNESS_HEADER
from plimsoll.runtime.testing import ThreadedServer

# 40 tokens: two full 16-token blocks can be served from the cache.
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def salted(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, block_size=16, server={"enable_prompt_tokens_details": True})
    yield srv
    srv.stop()


def cached(srv: ThreadedServer, prompt: list[int], tenant: str | None = None, salt: str | None = None) -> int:
    headers = {FAIRNESS_HEADER: tenant} if tenant else {}
    body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_second_tenant_gets_no_hit_and_the_same_tenant_does(salted: ThreadedServer) -> None:
    prompt = [*PROMPT, 1]
    assert cached(salted, prompt, tenant="team-a") == 0
    assert cached(salted, prompt, tenant="team-a") == 32  # the same tenant: both full blocks hit
    assert cached(salted, prompt, tenant="team-b") == 0  # identical prompt, another tenant: a miss
    assert cached(salted, prompt, tenant="team-b") == 32
    assert (
        cached(salted, prompt) == 0
    )  # no tenant: the shared (unsalted) cache, which holds nothing of theirs


def test_cache_salt_separates_requests_of_one_tenant(salted: ThreadedServer) -> None:
    prompt = [*PROMPT, 2]
    assert cached(salted, prompt, tenant="team-c", salt="alice") == 0
    assert cached(salted, prompt, tenant="team-c", salt="alice") == 32
    assert cached(salted, prompt, tenant="team-c", salt="bob") == 0
    assert cached(salted, prompt, tenant="team-c") == 0


def test_cached_tokens_are_hidden_by_default(chat_model_dir: Path) -> None:  # noqa: F811
    srv = start_server(chat_model_dir, block_size=16)
    try:
        for _ in range(2):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"].get("prompt_tokens_details") is None
    finally:
        srv.stop()


def test_salt_parts_cannot_be_shifted_into_each_other() -> None:
    import types

    from plimsoll.runtime.serving.requests import cache_salt_of
    from plimsoll.runtime.serving.settings import ServerSettings

    settings = ServerSettings(served_model_name="m")

    def salt(tenant: str | None, body: str | None) -> str | None:
        raw = types.SimpleNamespace(headers={FAIRNESS_HEADER: tenant} if tenant else {})
        return cache_salt_of(raw, body, settings)  # type: ignore[arg-type]

    assert salt("a", "b:c") != salt("a:b", "c")
    assert salt(None, None) is None
    off = ServerSettings(served_model_name="m", tenant_cache_isolation=False)
    raw = types.SimpleNamespace(headers={FAIRNESS_HEADER: "a"})
    assert cache_salt_of(raw, None, off) is None  # type: ignore[arg-type]
