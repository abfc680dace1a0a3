"""The replica's admin credential: control endpoints need ``--admin-api-key``; the inference key does not open them.

One real `plimsoll serve` process, both keys given through the environment (as the
operator's pods get them from Secrets), so neither appears in the process's arguments.
"""

import socket
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import chat_model_dir  # noqa: F401  (fixture)

from plimsoll.runtime.testing import ServerProcess, write_random_lora

ADMIN_KEY = "admin-3f9a"
API_KEY = "inference-77c1"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
INFERENCE = {"Authorization": f"Bearer {API_KEY}"}
SLO = {"ttftP95Ms": 500, "tpotP50Ms": 50, "e2eP95Ms": 5000}


@pytest.fixture(scope="module")
def adapter_root(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    root = tmp_path_factory.mktemp("admin-adapters")
    write_random_lora(chat_model_dir, root / "extra", 2, ("v_proj",), 4.0, seed=3)
    return root


@pytest.fixture(scope="module")
def replica(chat_model_dir: Path, adapter_root: Path) -> Iterator[ServerProcess]:  # noqa: F811
    args = ["--model", str(chat_model_dir), "--max-model-len", "128", "--kv-cache-memory", "4MiB",
            "--enable-lora", "--allow-runtime-lora-updating", "--lora-allowed-roots", str(adapter_root),
            "--allow-client-chat-template"]  # fmt: skip
    env = {"PLIMSOLL_ADMIN_API_KEY": ADMIN_KEY, "PLIMSOLL_API_KEY": API_KEY}
    with ServerProcess(args, env=env, startup_timeout=240) as server:
        yield server


def control_calls(adapter_root: Path) -> list[tuple[str, str, Any]]:
    return [
        ("POST", "/drain", None),
        ("DELETE", "/drain", None),
        ("PUT", "/slo", SLO),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": str(adapter_root / "extra")}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "extra"}),
        ("POST", "/debug/profile?seconds=1", None),
    ]


def test_control_endpoints_refuse_everyone_without_the_admin_key(
    replica: ServerProcess, adapter_root: Path
) -> None:
    slo_before = httpx.get(f"{replica.url}/slo").json()
    for headers in ({}, INFERENCE, {"Authorization": "Bearer guess"}):
        for method, path, body in control_calls(adapter_root):
            r = httpx.request(method, replica.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert "admin key" in r.json()["error"]["message"]
        ready = httpx.get(f"{replica.url}/ready")
        assert ready.status_code == 200, ready.text  # nobody drained the replica
    assert httpx.get(f"{replica.url}/slo").json() == slo_before
    assert "extra" not in {
        m["id"] for m in httpx.get(f"{replica.url}/v1/models", headers=INFERENCE).json()["data"]
    }


def test_the_admin_key_works_and_the_keys_are_not_in_the_arguments(
    replica: ServerProcess, adapter_root: Path
) -> None:
    url = replica.url
    assert httpx.post(f"{url}/drain", headers=ADMIN).json()["markedForRemoval"] is True
    assert httpx.get(f"{url}/ready").json()["reason"] == "marked for removal"
    assert httpx.delete(f"{url}/drain", headers=ADMIN).json()["markedForRemoval"] is False
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.put(f"{url}/slo", json=SLO, headers=ADMIN).status_code == 200
    assert httpx.get(f"{url}/slo").json()["ttftP95Ms"] == 500
    path = str(adapter_root / "extra")
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": path}, headers=ADMIN
    )
    assert loaded.status_code == 200, loaded.text
    # The inference key still serves /v1 (and the admin key does too: one credential for the operator).
    for headers in (INFERENCE, ADMIN):
        out = httpx.post(f"{url}/v1/completions", json={"model": "extra", "prompt": [5, 6], "max_tokens": 2},
                         headers=headers, timeout=60)  # fmt: skip
        assert out.status_code == 200, out.text
    assert (
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=ADMIN).status_code
        == 200
    )
    assert replica.proc is not None
    cmdline = Path(f"/proc/{replica.proc.pid}/cmdline").read_bytes()
    assert ADMIN_KEY.encode() not in cmdline and API_KEY.encode() not in cmdline


def test_chat_template_workers_do_not_inherit_the_keys(replica: ServerProcess) -> None:
    """Client templates render in child processes; neither key is in their environment."""
    assert replica.proc is not None
    pid = replica.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    workers = [c for c in children if b"template" in Path(f"/proc/{c}/cmdline").read_bytes()
               or b"multiprocessing" in Path(f"/proc/{c}/cmdline").read_bytes()]  # fmt: skip
    assert workers, children
    for child in workers:
        environ = Path(f"/proc/{child}/environ").read_bytes()
        assert ADMIN_KEY.encode() not in environ and API_KEY.encode() not in environ


def test_a_request_without_the_key_is_refused_before_its_body_is_read(replica: ServerProcess) -> None:
    """A chunked body that never ends: the 401 comes back at once instead of the server waiting for it."""
    host, port = replica.url.removeprefix("http://").split(":")
    for path in ("/v1/completions", "/drain"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n10\r\n{\"prompt\": \"hi\",\r\n".encode())  # fmt: skip
            head = sock.recv(4096).decode(errors="replace")  # the body's end is never sent
        assert head.startswith("HTTP/1.1 401"), (path, head[:200])


def _app(admin_api_key: str | None) -> Any:
    from plimsoll.runtime.serving.server import build_app
    from plimsoll.runtime.serving.settings import ServerSettings

    engine: Any = types.SimpleNamespace(
        is_ready=True, is_dead=False, config=types.SimpleNamespace(enable_lora=False)
    )
    return build_app(engine, ServerSettings(served_model_name="m", admin_api_key=admin_api_key))


@pytest.mark.parametrize("client", [("10.1.2.3", 40000), ("fd00::5", 40000)])
async def test_without_an_admin_key_control_endpoints_answer_loopback_only(client: tuple[str, int]) -> None:
    app = _app(None)
    remote = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url="http://r")
    local = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 40000)), base_url="http://r"
    )
    async with remote, local:
        for method, path in (("POST", "/drain"), ("DELETE", "/drain"), ("PUT", "/slo")):
            r = await remote.request(method, path, json={})
            assert r.status_code == 403, r.text
            assert "--admin-api-key" in r.json()["error"]["message"]
        assert not app.state.ctx.marked_for_removal
        assert (await local.post("/drain")).status_code == 200  # a developer's own machine
        assert app.state.ctx.marked_for_removal
        assert (await remote.get("/slo")).status_code == 200  # reading stays open, as /metrics does


async def test_an_admin_key_is_needed_from_loopback_too() -> None:
    app = _app("k")
    local = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 1)), base_url="http://r"
    )
    async with local:
        assert (await local.post("/drain")).status_code == 401
        assert (await local.post("/drain", headers={"Authorization": "Bearer k"})).status_code == 200
    assert app.state.ctx.marked_for_removal


def test_the_wake_key_opens_post_wake_up_and_nothing_else() -> None:
    from plimsoll.runtime.serving.auth import AuthMiddleware

    auth = AuthMiddleware(None, api_key="inference", admin_api_key="admin", wake_api_key="wake")  # type: ignore[arg-type]

    def status(method: str, path: str, key: str | None) -> int:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        refusal = auth._refusal({"path": path, "method": method, "headers": headers, "client": ("10.0.0.9", 1)})
        return 200 if refusal is None else refusal.status

    assert status("POST", "/wake_up", "wake") == 200 and status("POST", "/wake_up", "admin") == 200
    assert status("POST", "/wake_up", None) == 401 and status("POST", "/wake_up", "inference") == 401
    for method, path in (("POST", "/sleep"), ("POST", "/drain"), ("PUT", "/slo"), ("POST", "/v1/load_lora_adapter")):
        assert status(method, path, "wake") == 401, path  # a router's key reaches no other control endpoint
    assert status("POST", "/v1/completions", "wake") == 401  # nor inference
    assert AuthMiddleware(None, None, "admin", None)._refusal(  # type: ignore[arg-type]
        {"path": "/wake_up", "method": "POST", "headers": [(b"authorization", b"Bearer ")], "client": None}
    ) is not None  # no wake key configured: an empty bearer opens nothing
