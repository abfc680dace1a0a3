"""``POST /debug/profile`` and `plimsoll profile` against real servers on a tiny random model.

The CLI test runs `plimsoll serve --enable-profiling --api-key ...` as a process and
fetches a torch trace with `plimsoll profile` while requests are being served: the
file must be Chrome trace JSON whose ``traceEvents`` hold ``engine_step`` spans, and
the server must answer (a second profile gets 409, a completion completes) while the
first one records. The rest use the in-process server: off by default, bounded
seconds, kinds, the API key, and py-spy missing.
"""

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from plimsoll.cli import app
from plimsoll.runtime.serving import profiling
from plimsoll.runtime.testing import ServerProcess, ThreadedServer, write_tiny_model

pytestmark = pytest.mark.timeout(300)

KEY = "profile-test-key"
ADMIN_KEY = "profile-admin-key"
SMALL = ["--max-model-len", "256", "--kv-cache-memory", "4MiB", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.getbasetemp() / "plimsoll-profile-tiny")


def _complete(url: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "hello there",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )


def _engine_steps(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("name") == "engine_step" and e.get("ph") == "X"]


def test_plimsoll_profile_fetches_a_chrome_trace_with_engine_step_spans(
    model_dir: Path, tmp_path: Path
) -> None:
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--enable-profiling", "--api-key", KEY,
            "--admin-api-key", ADMIN_KEY,
            "--profile-dir", str(tmp_path / "on-pod"), *SMALL]  # fmt: skip
    with ServerProcess(args) as server:
        result: dict[str, Any] = {}

        def run_cli() -> None:
            result["cli"] = CliRunner().invoke(
                app, ["profile", "--url", server.url, "--seconds", "6", "-o", str(tmp_path / "out"),
                      "--admin-api-key", ADMIN_KEY],
            )  # fmt: skip

        cli = threading.Thread(target=run_cli)
        cli.start()
        # While it records the server answers: a second profile is refused, requests complete.
        while "profiling for 6s" not in server.log():
            cli.join(0.1)
            assert cli.is_alive(), result["cli"].output
        second = httpx.post(
            f"{server.url}/debug/profile", params={"seconds": 1},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30,
        )  # fmt: skip
        assert second.status_code == 409, second.text
        assert "already being taken" in second.json()["error"]["message"]
        answers = [_complete(server.url) for _ in range(3)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert cli.is_alive(), "the profile ended before the requests sent during it"
        cli.join(120)
        out = result["cli"]
        assert out.exit_code == 0, out.output
        files = list((tmp_path / "out").glob("profile-*-torch.json"))
        assert len(files) == 1, out.output
        trace = json.loads(files[0].read_text())
        assert isinstance(trace["traceEvents"], list)
        steps = _engine_steps(trace)
        assert steps, "no engine_step span in the trace"
        assert all(s["dur"] > 0 for s in steps)
        # The replica kept a gzip copy on its own volume and said where.
        kept = list((tmp_path / "on-pod").glob("profile-*-torch.json.gz"))
        assert len(kept) == 1 and str(kept[0]) in out.output


@pytest.fixture(scope="module")
def profiling_server(model_dir: Path) -> Any:
    srv = ThreadedServer(
        model_dir, server={"enable_profiling": True, "api_key": KEY, "admin_api_key": ADMIN_KEY}, served_model_name="tiny", max_model_len=256,
        kv_cache_memory="4MiB", max_num_seqs=8,
    ).start()  # fmt: skip
    yield srv
    srv.stop()


def _profile(url: str, key: str | None = ADMIN_KEY, **params: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/debug/profile", params=params, headers=headers, timeout=60)


def test_profiling_is_off_by_default_and_says_how_to_turn_it_on(model_dir: Path) -> None:
    with ThreadedServer(model_dir, max_model_len=256, kv_cache_memory="4MiB") as srv:
        response = _profile(srv.url, key=None, seconds=1)
    assert response.status_code == 404
    assert "--enable-profiling" in response.json()["error"]["message"]


def test_the_admin_key_guards_the_profile_endpoint(profiling_server: ThreadedServer) -> None:
    missing = _profile(profiling_server.url, key=None, seconds=1)
    wrong = _profile(profiling_server.url, key="nope", seconds=1)
    inference = _profile(profiling_server.url, key=KEY, seconds=1)  # the inference key is not enough
    assert (missing.status_code, wrong.status_code, inference.status_code) == (401, 401, 401)
    assert "missing" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    ("params", "needle"),
    [({}, "seconds is required"), ({"seconds": "soon"}, "not a number"), ({"seconds": 0}, "between 1 and 300"),
     ({"seconds": 301}, "between 1 and 300"), ({"seconds": 1, "kind": "perf"}, "use torch or py-spy")],
)  # fmt: skip
def test_bad_profile_requests_say_what_to_send(
    profiling_server: ThreadedServer, params: dict[str, Any], needle: str
) -> None:
    response = _profile(profiling_server.url, **params)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


def test_a_torch_profile_in_process_has_one_span_per_step(profiling_server: ThreadedServer) -> None:
    steps_before = profiling_server.engine.engine.stats()
    holder: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: holder.setdefault("r", _profile(profiling_server.url, seconds=2))
    )
    thread.start()
    while not profiling_server.engine.step_profiler.is_active:
        thread.join(0.05)
    assert _complete(profiling_server.url, max_tokens=6).status_code == 200
    thread.join(60)
    response = holder["r"]
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    steps = _engine_steps(response.json())
    # 6 tokens: one prefill step and five decode steps, all inside the window.
    assert len(steps) == 6, (len(steps), steps_before)


def test_py_spy_missing_is_a_501_that_says_to_install_it(
    profiling_server: ThreadedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(profiling, "py_spy_binary", lambda: None)
    response = _profile(profiling_server.url, seconds=1, kind="py-spy")
    assert response.status_code == 501
    assert "pip install py-spy" in response.json()["error"]["message"]


@pytest.mark.skipif(profiling.py_spy_binary() is None, reason="py-spy is not installed (pip install py-spy)")
def test_py_spy_returns_a_flame_graph_of_the_process(profiling_server: ThreadedServer) -> None:
    response = _profile(profiling_server.url, seconds=1, kind="py-spy")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("image/svg+xml")
    assert b"<svg" in response.content[:2000]


@pytest.mark.skipif(profiling.py_spy_binary() is None, reason="py-spy is not installed (pip install py-spy)")
def test_py_spy_is_let_in_alone_and_only_while_it_runs(
    profiling_server: ThreadedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = profiling.set_ptracer
    monkeypatch.setattr(profiling, "set_ptracer", lambda pid: (calls.append(pid), real(pid)))
    response = _profile(profiling_server.url, seconds=1, kind="py-spy")
    assert response.status_code == 200, response.text
    # One named tracer (py-spy's pid), then the permission taken back; never "any process".
    assert len(calls) == 2 and calls[0] > 0 and calls[1] == 0, calls


def test_profiles_go_to_a_private_directory(tmp_path: Path) -> None:
    fresh = profiling.default_profile_dir()
    try:
        assert fresh.name.startswith("plimsoll-profiles-") and (fresh.stat().st_mode & 0o777) == 0o700
        assert profiling.default_profile_dir() != fresh  # not a name another user could take first
    finally:
        fresh.rmdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for folder in (shared, link):
        with pytest.raises(profiling.APIError):
            profiling.ProfileStore(folder).save("torch", ".json.gz", b"x")
    assert not list(shared.iterdir())


async def test_a_profile_larger_than_the_cap_is_refused_without_holding_it() -> None:
    """What the operator reads from a replica is capped: a server sending 64 MiB is cut at 1 MiB."""
    import http.server
    import socketserver

    from plimsoll.profile_fetch import ProfileError, take_profile

    class Flood(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(64 << 20))
            self.end_headers()
            total = 0
            try:
                while total < 64 << 20:
                    self.wfile.write(b"x" * (1 << 20))
                    total += 1 << 20
            except OSError:
                pass  # the reader hung up at its cap

        def log_message(self, *_: Any) -> None:
            pass

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Flood) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with pytest.raises(ProfileError, match="larger than 1048576 bytes"):
                await take_profile(f"http://127.0.0.1:{server.server_address[1]}", 1, max_bytes=1 << 20)
        finally:
            server.shutdown()
