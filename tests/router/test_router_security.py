"""The router as the front door: clients authenticate, tenants come from their keys, bodies are capped.

A real `plimsoll route` process in front of a real replica (the tiny model, in-process,
with its own API key, prompt-token details on and a tenant cap): the router checks the
client's key (the service key, or a tenant's key from a Secret-like directory), sends
the replica its own key, sets the tenant header itself (dropping what a client sent),
and refuses a 1 GiB body with 413 without holding it.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_harness import free_port, route_process, run_router

from plimsoll.objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER
from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

SERVICE_KEY = "svc-key-5d1e"
TENANTS = {"team-a": "key-a-91f0", "team-b": "key-b-0c33"}
CAP = 200  # tokens in flight per tenant on the replica
PROMPT = list(range(100, 140))  # two full 16-token blocks
GIB = 1 << 30


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    model = write_tiny_model(tmp_path_factory.getbasetemp() / "plimsoll-chat-tiny")
    server = {"api_key": SERVICE_KEY, "enable_prompt_tokens_details": True, "max_tenant_inflight_tokens": CAP}
    with ThreadedServer(model, server=server, max_model_len=256, kv_cache_memory="4MiB", block_size=16,
                        served_model_name="tiny") as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def router(replica: ThreadedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    keys = tmp_path_factory.mktemp("tenant-keys")
    for tenant, key in TENANTS.items():
        (keys / tenant).write_text(key + "\n")
    args = [
        "--backend",
        replica.url,
        "--tenant-keys-dir",
        str(keys),
        "--scrape-interval",
        "0.2",
        "--log-level",
        "warning",
    ]
    with route_process(args, env={"PLIMSOLL_API_KEY": SERVICE_KEY}) as (url, process):
        yield url, process.pid
    process.communicate(timeout=30)


def complete(url: str, key: str | None, prompt: list[int] | str = "hi", **headers: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, headers={**auth, **headers}, timeout=60)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_clients_authenticate_and_the_keys_stay_out_of_the_arguments(router: tuple[str, int]) -> None:
    url, pid = router
    for key in (None, "guess", SERVICE_KEY[:-1]):
        refused = complete(url, key)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "AuthenticationError"
    for key in (SERVICE_KEY, *TENANTS.values()):
        assert complete(url, key).status_code == 200  # the replica got the service key from the router
    assert httpx.get(f"{url}/v1/models").status_code == 401
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert SERVICE_KEY.encode() not in cmdline


def test_tenants_do_not_share_the_prefix_cache_behind_the_router(router: tuple[str, int]) -> None:
    url, _ = router
    a, b = TENANTS["team-a"], TENANTS["team-b"]
    prompt = [*PROMPT, 7]
    assert cached(complete(url, a, prompt)) == 0
    assert cached(complete(url, a, prompt)) == 32  # the same tenant: its cached blocks
    # Another tenant, even claiming to be team-a: the router sets the header from its key.
    assert cached(complete(url, b, prompt, **{FAIRNESS_HEADER: "team-a"})) == 0
    assert cached(complete(url, b, prompt)) == 32


def test_a_clients_gateway_headers_are_dropped(router: tuple[str, int]) -> None:
    url, _ = router
    # An objective the replica does not know would be a 400 there: the header never arrives.
    assert complete(url, SERVICE_KEY, **{OBJECTIVE_HEADER: "gold"}).status_code == 200
    # A tenant cannot leave its own bucket by naming another: over the cap it is still team-a's 429.
    big = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": CAP + 10},
                     headers={"Authorization": f"Bearer {TENANTS['team-a']}", FAIRNESS_HEADER: "team-z"},
                     timeout=60)  # fmt: skip
    assert big.status_code == 429 and "'team-a'" in big.json()["error"]["message"], big.text


def test_ready_names_no_pod_address(router: tuple[str, int], replica: ThreadedServer) -> None:
    url, _ = router
    ready = httpx.get(f"{url}/ready").json()
    assert ready["ready"] is True and ready["ready_replicas"] == 1
    assert "127.0.0.1" not in str(ready)


def _response_while_sending(sock: socket.socket, chunk: bytes, total: int, chunked: bool) -> bytes:
    """Send up to ``total`` body bytes, reading the answer as soon as one arrives."""
    sent = 0
    while sent < total:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            break
        piece = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(chunk)
    sock.settimeout(30)
    answer = b""
    while True:  # the head and the body may come in separate segments
        head, _, body = answer.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)  # fmt: skip
        if length is not None and len(body) >= length:
            return answer
        try:
            more = sock.recv(65536)
        except ConnectionResetError:
            return answer
        if not more:
            return answer
        answer += more


@pytest.mark.parametrize("chunked", [False, True], ids=["declared-length", "chunked"])
def test_a_1gib_body_gets_413_and_the_router_lives(router: tuple[str, int], chunked: bool) -> None:
    url, pid = router
    port = int(url.rsplit(":", 1)[1])
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {GIB}"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {SERVICE_KEY}\r\n"
                     f"Content-Type: application/json\r\n{length}\r\n\r\n".encode())  # fmt: skip
        head = _response_while_sending(sock, b"x" * (1 << 20), GIB, chunked)
    assert head.startswith(b"HTTP/1.1 413"), head[:300]
    assert b"--max-request-bytes" in head
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert complete(url, SERVICE_KEY).status_code == 200
    # The router never held the body: its peak resident memory stayed far below 1 GiB.
    peak_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmHWM:"))  # fmt: skip
    print(f"\n1 GiB body ({'chunked' if chunked else 'declared length'}): 413, router peak RSS {peak_kib / 1024:.0f} MiB")
    assert peak_kib < 400 * 1024, f"router peak RSS {peak_kib} KiB"


async def test_at_zero_replicas_only_authenticated_generation_is_held() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with run_router(backends=(dead,), hold_queue=4, hold_timeout_s=1, api_key=SERVICE_KEY) as router, \
            httpx.AsyncClient(timeout=30) as client:  # fmt: skip
        anonymous = await client.post(f"{router.url}/v1/completions", json={"prompt": "hi"})
        assert anonymous.status_code == 401
        models = await client.get(
            f"{router.url}/v1/models", headers={"Authorization": f"Bearer {SERVICE_KEY}"}
        )
        assert models.status_code == 503  # answered at once, not held: a GET is no reason to start a GPU
        assert router.state.hold is not None and router.state.hold.max_held == 0
        held = await client.post(f"{router.url}/v1/completions", json={"prompt": "hi"},
                                 headers={"Authorization": f"Bearer {SERVICE_KEY}"})  # fmt: skip
        assert held.status_code == 503 and router.state.hold.max_held == 1  # held, then timed out
