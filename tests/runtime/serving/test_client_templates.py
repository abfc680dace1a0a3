"""--allow-client-chat-template: a user's template renders in a worker process, bounded in time and output.

A hostile template (nested loops, a huge string, a syntax error) gets a clear 400 while
``/health`` keeps answering throughout (asserted on answering, never on latency); the
worker that overran is killed and replaced, and the next template renders normally.
Readiness of the pool is awaited on its own marker (workers idle), not on a sleep.
"""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401  (fixtures)

from plimsoll.runtime.testing import TINY_CHAT_TEMPLATE, ThreadedServer

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]
NESTED_LOOPS = "{% for a in range(400) %}{% for b in range(400) %}{% for c in range(400) %}x{% endfor %}{% endfor %}{% endfor %}"
BUDGET_S = 2.0


@pytest.fixture(scope="module")
def srv(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    server = {"allow_client_chat_template": True, "tokenize_timeout": BUDGET_S, "chat_template_workers": 2}
    with start_server(chat_model_dir, server=server) as s:
        yield s


def wait_for_idle_workers(srv: ThreadedServer, n: int = 2) -> None:
    pool = srv.ctx.templates
    assert pool is not None
    deadline = time.monotonic() + 180  # each worker imports transformers' renderer once
    while pool.num_idle < n:
        assert time.monotonic() < deadline, "the template workers never became ready"
        time.sleep(0.05)


def chat(srv: ThreadedServer, template: str | None, **extra: object) -> httpx.Response:
    kwargs = {"chat_template": template} if template is not None else {}
    body = {"messages": MSG, "max_tokens": 2, "temperature": 0, "chat_template_kwargs": kwargs, **extra}
    return httpx.post(srv.url + CHAT, json=body, timeout=120)


def test_a_client_template_renders_like_the_models_own(srv: ThreadedServer) -> None:
    wait_for_idle_workers(srv)
    own = chat(srv, None)
    client = chat(srv, TINY_CHAT_TEMPLATE)
    assert own.status_code == client.status_code == 200, client.text
    assert client.json()["usage"]["prompt_tokens"] == own.json()["usage"]["prompt_tokens"]
    assert client.json()["choices"][0]["message"] == own.json()["choices"][0]["message"]
    # The context a template sees: the special tokens and the client's own kwargs.
    template = "{{ bos_token }}{{ greeting }}{{ messages[0]['content'] | upper }}"
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"chat_template": template, "greeting": "hey "}}
    shout = httpx.post(srv.url + CHAT, json=body, timeout=120)
    assert shout.status_code == 200, shout.text
    assert shout.json()["usage"]["prompt_tokens"] == 1 + len("hey HELLO THERE")  # <s> is one token


@pytest.mark.parametrize(
    ("template", "says"),
    [
        (NESTED_LOOPS, f"took longer than {BUDGET_S:g}s"),
        ("{{'ab ' * 5000}}", "rendered 15000 characters"),  # over 256 tokens x 32 chars, and fast
        ("{% for %}", "The chat template rejected these messages"),
    ],
    ids=["huge-loop", "huge-output", "syntax-error"],
)
def test_a_hostile_template_gets_a_400_while_health_keeps_answering(
    srv: ThreadedServer, template: str, says: str
) -> None:
    wait_for_idle_workers(srv)
    pool = srv.ctx.templates
    assert pool is not None
    before = pool.pids
    result: dict[str, httpx.Response] = {}
    hostile = threading.Thread(target=lambda: result.setdefault("r", chat(srv, template)))
    hostile.start()
    probes = []
    with httpx.Client(timeout=30) as client:
        while hostile.is_alive() or len(probes) < 5:
            probes.append(client.get(f"{srv.url}/health").status_code)
    hostile.join()
    r = result["r"]
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert probes and set(probes) == {200}, probes  # every probe answered during the render
    if template == NESTED_LOOPS:
        killed = before - pool.pids
        assert len(killed) == 1  # the overrunning worker was killed and a new one spawned
        wait_for_idle_workers(srv)
    else:
        assert pool.pids == before  # a refused render keeps its worker
    assert chat(srv, TINY_CHAT_TEMPLATE).status_code == 200  # the pool serves on
