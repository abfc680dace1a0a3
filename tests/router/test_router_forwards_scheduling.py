"""The router forwards what the replica schedules by: the tenant header, the objective header, the body's priority.

A real router (uvicorn, real sockets) in front of a real `plimsoll serve` stack (the
tiny model, in-process) over HTTP. What the replica received is read from what it
does with it: the tenant cap answers 429 naming the tenant, and the per-priority-class
counter counts the class each request was served in.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from router_harness import run_router

from plimsoll import metric_names as mn
from plimsoll.prometheus import parse
from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

CAP = 40  # tokens in flight per tenant (prompt + max_tokens)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    model = write_tiny_model(tmp_path_factory.getbasetemp() / "plimsoll-chat-tiny")
    server = {"max_tenant_inflight_tokens": CAP, "inference_objectives": {"critical": -10, "sheddable": 5}}
    with ThreadedServer(
        model, server=server, max_model_len=256, kv_cache_memory="4MiB", scheduling_policy="priority",
        served_model_name="tiny",
    ) as srv:
        yield srv


def served_in_class(replica: ThreadedServer, priority: str) -> float:
    scrape = parse(httpx.get(f"{replica.url}/metrics", timeout=10).text)
    return sum(v for labels, v in scrape.samples.get(mn.PRIORITY_REQUESTS, []) if dict(labels)["priority"] == priority)


async def test_router_forwards_fairness_id_objective_and_priority(replica: ThreadedServer) -> None:
    # Behind a gateway that sets the x-gateway-inference-* headers itself (the default drops clients' copies).
    async with run_router(backends=(replica.url,), trust_gateway_headers=True) as router, \
            httpx.AsyncClient(timeout=60) as client:  # fmt: skip
        url = f"{router.url}/v1/completions"
        # prompt (~10 tokens) + max_tokens 64 > CAP: over the tenant's cap only if the header arrived.
        too_big = {"model": "tiny", "prompt": "over the cap", "max_tokens": 64}
        capped = await client.post(url, json=too_big, headers={"x-gateway-inference-fairness-id": "team-z"})
        assert capped.status_code == 429, capped.text
        assert "'team-z'" in capped.json()["error"]["message"]
        assert capped.headers["x-plimsoll-replica"] == replica.url  # the replica said it, not the router
        anonymous = await client.post(url, json=too_big)  # no tenant: the shared bucket, under the same cap
        assert anonymous.status_code == 429 and "without a tenant" in anonymous.json()["error"]["message"]

        before = {c: served_in_class(replica, c) for c in ("3", "-10", "5")}
        small = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        by_body = await client.post(url, json={**small, "priority": 3})
        by_objective = await client.post(
            url, json={**small, "priority": 3}, headers={"x-gateway-inference-objective": "critical"}
        )
        chat = await client.post(
            f"{router.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"x-gateway-inference-objective": "sheddable"},
        )
        assert by_body.status_code == by_objective.status_code == chat.status_code == 200
        after = {c: served_in_class(replica, c) for c in ("3", "-10", "5")}
        # The body's priority 3 reached the replica; an objective overrides it (the settings hold vLLM
        # priorities: parse_objectives turned spec.priority 10 into -10 and -5 into 5).
        assert after["3"] - before["3"] == 1
        assert after["-10"] - before["-10"] == 1
        assert after["5"] - before["5"] == 1

        unknown = await client.post(url, json=small, headers={"x-gateway-inference-objective": "gold"})
        assert unknown.status_code == 400
        message = unknown.json()["error"]["message"]
        assert "'gold'" in message and "critical, sheddable" in message and "--inference-objective" in message


def test_objective_map_flips_the_sign_and_refuses_bad_entries() -> None:
    from plimsoll.objectives import objective_priority, parse_objectives

    objectives = parse_objectives(["critical=10", " batch = -3 "])
    assert objectives == {"critical": -10, "batch": 3}
    assert objective_priority("critical", 7, objectives) == -10
    assert objective_priority(None, 7, objectives) == 7
    assert objective_priority("", 7, objectives) == 7
    for bad, says in (("critical", "NAME=PRIORITY"), ("x=high", "not an integer"), ("=3", "NAME=PRIORITY")):
        with pytest.raises(ValueError, match=says):
            parse_objectives([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_objectives(["a=1", "a=2"])


def test_the_router_releases_held_requests_by_objective() -> None:
    from plimsoll.router.proxy import hold_priority

    objectives = {"critical": -10}
    body = b'{"priority": 4}'
    assert hold_priority("critical", body, objectives) == -10
    assert hold_priority(None, body, objectives) == 4
    assert hold_priority("gold", body, objectives) == 4  # forwarded; the replica answers the 400
