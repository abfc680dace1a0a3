"""SLO-aware admission on a real server: a request predicted to miss its TTFT bound is refused at once.

The engine steps are slowed to 40 ms (any CPU then has a queue that lasts), one
sequence at a time, so a second request waits behind the first one's 30 tokens.
"""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, metric, scrape, start_server  # noqa: F401

from plimsoll import metric_names as mn
from plimsoll.overload import OVERLOAD_HEADER
from plimsoll.runtime.testing import ThreadedServer
from plimsoll.ttft_prediction import PREDICTED_TTFT_HEADER, REFUSED_IN_QUEUE_HEADER, SLO_TTFT_HEADER

BODY = {"prompt": "hello there", "max_tokens": 30, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, server={"slo_admission": True}, step_delay=0.04, max_num_seqs=1)
    yield srv
    srv.stop()


def _busy(url: str, max_tokens: int = 30) -> threading.Thread:
    """One long request occupying the only slot (returns once it is running)."""
    body = {**BODY, "max_tokens": max_tokens}
    worker = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120))
    worker.start()
    deadline = time.monotonic() + 60
    while metric(scrape(url), mn.NUM_REQUESTS_RUNNING) < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)
    return worker


def test_a_request_that_would_wait_past_its_bound_gets_429_with_retry_after(slow: ThreadedServer) -> None:
    worker = _busy(slow.url)
    try:
        # The queue in tokens and seconds: the running request still has most of its 30 tokens to
        # go. The engine measures its decode step as it runs, so the backlog in seconds reaches
        # remaining tokens × the slowed step after a few steps, not at the first scrape.
        deadline = time.monotonic() + 30
        while True:
            samples = scrape(slow.url)
            remaining, backlog = (
                metric(samples, mn.DECODE_TOKENS_REMAINING),
                metric(samples, mn.BACKLOG_SECONDS),
            )
            if backlog > 0.3 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert remaining > 10 and backlog > 0.3, (remaining, backlog)
        refused = httpx.post(
            f"{slow.url}/v1/completions", json=BODY, headers={SLO_TTFT_HEADER: "200"}, timeout=60
        )
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1 and refused.headers[OVERLOAD_HEADER] == "replica"
        assert "would miss its TTFT bound of 200 ms" in refused.json()["error"]["message"]
        # A bound the queue can meet is admitted, and the request is served.
        admitted = httpx.post(f"{slow.url}/v1/completions", json={**BODY, "max_tokens": 2},
                              headers={SLO_TTFT_HEADER: "600000"}, timeout=120)  # fmt: skip
        assert admitted.status_code == 200, admitted.text
        # Both answers say what the replica predicted: the refused one past its bound, the
        # admitted one within it (a client or a benchmark compares it with what it measured).
        assert float(refused.headers[PREDICTED_TTFT_HEADER]) > 200
        assert 0 < float(admitted.headers[PREDICTED_TTFT_HEADER]) <= 600000
    finally:
        worker.join()
    assert metric(scrape(slow.url), mn.ADMISSION_REJECTIONS, reason="slo_ttft") == 1


def test_the_objective_is_the_default_bound_and_a_shed_request_counts_as_bad(slow: ThreadedServer) -> None:
    assert httpx.put(f"{slow.url}/slo", json={"ttftP95Ms": 150}, timeout=10).status_code == 200
    before = scrape(slow.url)
    worker = _busy(slow.url)
    try:
        refused = httpx.post(f"{slow.url}/v1/completions", json=BODY, timeout=60)  # no header: the objective
        assert refused.status_code == 429, refused.text
    finally:
        worker.join()
    after = scrape(slow.url)
    bad = mn.SLO_REQUESTS.removesuffix("_total") + "_total"
    assert metric(after, bad, result="bad") - metric(before, bad, result="bad") >= 1
    httpx.put(f"{slow.url}/slo", json={}, timeout=10)


def test_a_bound_that_is_not_a_number_is_a_bad_request(slow: ThreadedServer) -> None:
    bad = httpx.post(f"{slow.url}/v1/completions", json=BODY, headers={SLO_TTFT_HEADER: "soon"}, timeout=60)
    assert bad.status_code == 400 and "x-slo-ttft-ms must be a number" in bad.json()["error"]["message"]


def test_an_idle_replica_admits_what_its_rates_say_would_miss(slow: ThreadedServer) -> None:
    # The rates are measured (a request ran); a 1 ms bound is below even one 40 ms step. While busy such a
    # request is refused; idle, it is admitted: refused requests measure nothing, so a rate measured in a
    # slow moment would otherwise refuse everything after it.
    assert (
        httpx.post(f"{slow.url}/v1/completions", json={**BODY, "max_tokens": 3}, timeout=120).status_code
        == 200
    )
    tight = {**BODY, "max_tokens": 2}
    worker = _busy(slow.url)
    try:
        busy = httpx.post(
            f"{slow.url}/v1/completions", json=tight, headers={SLO_TTFT_HEADER: "1"}, timeout=60
        )
        assert busy.status_code == 429, busy.text
    finally:
        worker.join()
    idle = httpx.post(f"{slow.url}/v1/completions", json=tight, headers={SLO_TTFT_HEADER: "1"}, timeout=120)
    assert idle.status_code == 200, idle.text


def test_a_streamed_answer_held_to_a_bound_starts_with_its_first_token(slow: ThreadedServer) -> None:
    # The rates are measured (a request ran): the bound is a promise the engine holds it to, and the
    # head waits for the first token (a refusal from the queue must still be able to be a 429).
    assert (
        httpx.post(f"{slow.url}/v1/completions", json={**BODY, "max_tokens": 3}, timeout=120).status_code
        == 200
    )
    body = {**BODY, "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{slow.url}/v1/completions", json=body, headers={SLO_TTFT_HEADER: "600000"}, timeout=120
    ) as answer:
        text = answer.read().decode()
    assert answer.status_code == 200 and PREDICTED_TTFT_HEADER in answer.headers
    assert text.count('"text_completion"') >= 3 and text.rstrip().endswith("data: [DONE]")


def test_an_admitted_request_the_replica_can_no_longer_serve_in_time_is_refused_from_the_queue(
    slow: ThreadedServer,
) -> None:
    worker = _busy(slow.url, max_tokens=200)  # the only slot: 200 tokens at 40 ms or more
    answer: dict[str, httpx.Response] = {}

    def streamed() -> None:
        body = {**BODY, "max_tokens": 2, "stream": True}
        with httpx.stream(
            "POST", f"{slow.url}/v1/completions", json=body, headers={SLO_TTFT_HEADER: "600000"}, timeout=120
        ) as response:
            response.read()
            answer["response"] = response

    try:
        # Admitted: the running request's steps are far within 600 s. It waits in the engine.
        client = threading.Thread(target=streamed)
        client.start()
        deadline = time.monotonic() + 60
        while metric(scrape(slow.url), mn.NUM_REQUESTS_WAITING) < 1:
            assert time.monotonic() < deadline, "the bounded request never reached the engine's queue"
            time.sleep(0.02)
        # Then the host stalls: a 100 s step, as the engine's meter records one. At the mean step it
        # moves the engine's rates to, the running request's remaining tokens alone take far past 600 s.
        slow.engine.engine.rate_meter.observe(0, 1, 100.0, end=time.monotonic())  # type: ignore[union-attr]
        client.join(timeout=120)
    finally:
        worker.join()
    refused = answer["response"]
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers[OVERLOAD_HEADER] == "replica"
    assert float(refused.headers[REFUSED_IN_QUEUE_HEADER]) > 0
    assert float(refused.headers[PREDICTED_TTFT_HEADER]) > 600000
    assert "can no longer meet its TTFT bound" in refused.json()["error"]["message"]
    assert metric(scrape(slow.url), mn.NUM_REQUESTS_WAITING) == 0
