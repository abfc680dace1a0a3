"""Drivers for scale-to-zero and two-phase scale-down runs on the local control plane.

Shared by ``test_scale_to_zero_k8s.py`` and ``benchmarks/scale_to_zero.py``: they
send real requests (plain and streaming ``/v1/completions``) to the router POD's
loopback IP (never a Service IP), watch the LLMService and its pods with kubectl,
and record when each phase was first seen (``time.monotonic()``).
"""

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from llms_k8s import condition, get_json


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def pods(cluster: Any, ns: str, name: str, component: str = "replica") -> list[dict[str, Any]]:
    found = get_json(cluster, "pods", "-n", ns, "-l",
                     f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}")  # fmt: skip
    return list((found or {}).get("items", []))


def is_ready(pod: dict[str, Any]) -> bool:
    return (condition(pod, "Ready") or {}).get("status") == "True" and not pod["metadata"].get(
        "deletionTimestamp"
    )


def router_ip(cluster: Any, ns: str, name: str) -> str | None:
    ready = [p["status"]["podIP"] for p in pods(cluster, ns, name, "router") if is_ready(p)]
    return ready[0] if len(ready) == 1 else None


def hold_state(ip: str) -> dict[str, Any]:
    demand: dict[str, Any] = httpx.get(f"http://{ip}:8000/hold", timeout=5, trust_env=False).json()
    return demand


def events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return list((items or {}).get("items", []))


@dataclass
class Outcome:
    """One request's answer as the client saw it."""

    index: int
    stream: bool
    status: int = 0
    retry_after: str | None = None
    message: str = ""
    first_byte_at: float | None = None
    first_byte_wall: float | None = None
    done_at: float | None = None
    complete: bool = False  # JSON with choices, or a stream that ended with [DONE]
    error: str | None = None


def send_one(base: str, model: str, index: int, stream: bool, max_tokens: int = 8) -> Outcome:
    out = Outcome(index, stream)
    body = {"model": model, "prompt": f"request {index}: tell me", "max_tokens": max_tokens, "stream": stream,
            "temperature": 0}  # fmt: skip
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(900, connect=10), trust_env=False) as http,
            http.stream("POST", f"{base}/v1/completions", json=body) as response,
        ):
            out.status = response.status_code
            out.retry_after = response.headers.get("retry-after")
            chunks = []
            for chunk in response.iter_text():
                if chunk and out.first_byte_at is None:
                    out.first_byte_at, out.first_byte_wall = time.monotonic(), time.time()
                chunks.append(chunk)
            text = "".join(chunks)
        out.done_at = time.monotonic()
        if out.status != 200:
            out.message = json.loads(text)["error"]["message"]
        elif stream:
            out.complete = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        else:
            out.complete = bool(json.loads(text).get("choices"))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def burst(base: str, model: str, count: int, streaming: Callable[[int], bool]) -> tuple[float, list[Outcome]]:
    """``count`` concurrent requests; returns when they were sent and every outcome."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        sent = time.monotonic()
        futures = [pool.submit(send_one, base, model, i, streaming(i)) for i in range(count)]
        return sent, [f.result() for f in futures]


def _wall(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@dataclass
class Watch:
    """The new replica's own timestamps during a cold start (wall clock, as the API server records them).

    Polls the pods with kubectl until a replica pod has been seen Ready, and keeps
    its container's ``startedAt`` and its Ready condition's ``lastTransitionTime``
    (whole seconds: the API server's resolution). Leaving the ``with`` block waits
    (up to 60 s) for them, since the pod may turn Ready before a slow poll sees it.
    """

    cluster: Any
    ns: str
    name: str
    interval: float = 0.25
    container_started: float | None = None
    ready_transition: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "Watch":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        deadline = time.monotonic() + 60
        while self.ready_transition is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set() and self.ready_transition is None:
            for pod in pods(self.cluster, self.ns, self.name):
                if not is_ready(pod):
                    continue
                for c in (pod.get("status") or {}).get("containerStatuses") or []:
                    started = _wall(((c.get("state") or {}).get("running") or {}).get("startedAt"))
                    self.container_started = started
                self.ready_transition = _wall((condition(pod, "Ready") or {}).get("lastTransitionTime"))
            self._stop.wait(self.interval)


@dataclass
class StreamLoad:
    """Closed-loop streaming clients against one URL until stopped; every stream's outcome kept."""

    base: str
    model: str
    clients: int
    max_tokens: int = 48
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> "StreamLoad":
        for c in range(self.clients):
            thread = threading.Thread(target=self._client, args=(c,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _client(self, c: int) -> None:
        i = 0
        while not self._stop.is_set():
            self.outcomes.append(send_one(self.base, self.model, c * 100_000 + i, True, self.max_tokens))
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def __exit__(self, *_: object) -> None:
        self.stop()

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200 or not o.complete or o.error]
