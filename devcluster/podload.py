"""Closed-loop load against the ready pods of one LLMService, and a recorder of its replica count.

What it is: the client side of the autoscaling checks on the local control plane.
``PodLoad`` runs N closed-loop clients (each sends a streaming
``/v1/completions`` request, waits for the last token, sends the next) against
the pods' own loopback IPs, picking the ready pod with the fewest of its
requests outstanding, as a queue-aware router would. It finds the pods through
the API server (the LLMService's ``status.selector``, each pod's Ready condition
and IP), never through a Service cluster IP. Every request is recorded with its
time to first token; a poller records ``spec.replicas``, ready replicas and each
new ``status.autoscaler`` decision, so a test can check the replica count over
time and a benchmark can compute SLO attainment.

It runs its own event loop in a background thread, so a synchronous test can
change the number of clients (``set_clients``) while it keeps calling kubectl.

With ``via`` every request goes to that URL instead (the LLMService's router), so
what the router does in front of the pods is part of what is measured.

What it is not: a benchmark tool (``plimsoll bench`` measures a replica's
capacity); it does not scale anything itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from plimsoll.devcluster.kubeapi import KubeAPI, KubeAPIError
from plimsoll.pods import named_port, pod_is_ready
from plimsoll.router.discovery import is_draining, is_parked

GROUP_PATH = "/apis/plimsoll.dev/v1alpha1"
DEFAULT_PORT = 8000
# After a failed request a pod is skipped this long, so clients do not spin on a dead process
# before the API server reports it unready.
ERROR_COOLDOWN_S = 2.0


@dataclass(frozen=True, slots=True)
class Completion:
    """One request: where it went, when (``time.monotonic()``), its TTFT and end-to-end time."""

    pod: str
    sent_at: float
    ttft_s: float | None  # None when no token came back
    e2e_s: float
    tokens: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """The LLMService as the poller saw it at ``at`` (``time.monotonic()``)."""

    at: float
    desired: int  # spec.replicas
    ready: int  # status.readyReplicas
    ready_pods: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """A ``status.autoscaler`` decision, first seen at ``seen_at`` (``time.monotonic()``)."""

    seen_at: float
    time: str
    current: int | None
    desired: int | None
    reason: str
    formula: str
    inputs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """What each request asks for. ``ignore_eos`` keeps a request in flight for all ``max_tokens``."""

    model: str
    prompt: str = "The quick brown fox jumps over the lazy dog."
    max_tokens: int = 64
    request_timeout_s: float = 120.0
    poll_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {self.poll_interval_s}")


@dataclass(slots=True)
class _Pod:
    url: str
    outstanding: int = 0
    skip_until: float = 0.0


@dataclass
class PodLoad:
    """Clients and recorder for LLMService ``name`` in ``namespace``; use as a context manager."""

    kubeconfig: Path
    namespace: str
    name: str
    config: LoadConfig
    # Which pods take the load: the LLMService's ``status.selector`` unless given (e.g. a split
    # service's prefill pool, ``app.kubernetes.io/instance=NAME,plimsoll.dev/role=prefill``).
    selector: str | None = None
    completions: list[Completion] = field(default_factory=list)
    samples: list[ReplicaSample] = field(default_factory=list)
    decisions: list[ScalingDecision] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)  # (time.monotonic(), clients)
    # Send every request to this URL (the LLMService's router) instead of picking a pod; the pods are
    # still polled for the replica count. Completions then name "router".
    via: str | None = None
    _pods: dict[str, _Pod] = field(default_factory=dict)
    _via_pod: _Pod | None = None
    _clients: list[asyncio.Task[None]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stopped: asyncio.Event | None = None
    _errors: list[BaseException] = field(default_factory=list)
    _http: httpx.AsyncClient | None = None

    # ---- used from the caller's thread ---------------------------------

    def __enter__(self) -> PodLoad:
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._stopped = asyncio.Event()
            loop.call_soon(started.set)
            try:
                loop.run_until_complete(self._main())
            except BaseException as error:  # surfaced by check() in the caller's thread
                self._errors.append(error)
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"podload-{self.name}", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the load thread did not start")
        return self

    def __exit__(self, *_: object) -> None:
        if self._loop is not None and self._stopped is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=30)

    def set_clients(self, count: int) -> None:
        """Run ``count`` closed-loop clients from now on; fewer cancels the newest (their requests abort)."""
        if count < 0:
            raise ValueError(f"client count must be 0 or more, got {count}")
        self._call(self._set_clients(count))

    def check(self) -> None:
        """Raise what broke the load thread, if anything did."""
        if self._errors:
            raise RuntimeError(f"the load thread failed: {self._errors[0]!r}") from self._errors[0]

    def ready_pods(self) -> dict[str, str]:
        """The pods the clients currently send to: name → base URL."""
        return {name: pod.url for name, pod in dict(self._pods).items()}

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        self.check()
        assert self._loop is not None, "use PodLoad as a context manager"
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    # ---- the event loop's side ------------------------------------------

    async def _set_clients(self, count: int) -> None:
        self.steps.append((time.monotonic(), count))
        while len(self._clients) > count:
            self._clients.pop().cancel()
        while len(self._clients) < count:
            self._clients.append(asyncio.create_task(self._client()))

    async def _main(self) -> None:
        assert self._stopped is not None
        api = KubeAPI(self.kubeconfig)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        try:
            async with httpx.AsyncClient(timeout=self.config.request_timeout_s, limits=limits) as http:
                self._http = http
                poller = asyncio.create_task(self._poll(api))
                await self._stopped.wait()
                for task in [*self._clients, poller]:
                    task.cancel()
                await asyncio.gather(*self._clients, poller, return_exceptions=True)
                self._clients.clear()
        finally:
            await api.aclose()

    async def _poll(self, api: KubeAPI) -> None:
        seen_decision: str | None = None
        while True:
            with contextlib.suppress(KubeAPIError, httpx.HTTPError):
                svc = await api.get(f"{GROUP_PATH}/namespaces/{self.namespace}/llmservices/{self.name}")
                status = svc.get("status") or {}
                selector = self.selector or status.get("selector")
                ready: dict[str, str] = {}
                if selector:
                    pods = await api.get(
                        f"/api/v1/namespaces/{self.namespace}/pods", params={"labelSelector": selector}
                    )
                    ready = {p["metadata"]["name"]: url for p in pods["items"] if (url := ready_url(p))}
                self._sync_pods(ready)
                now = time.monotonic()
                self.samples.append(
                    ReplicaSample(
                        at=now,
                        desired=int(svc["spec"].get("replicas") or 0),
                        ready=int(status.get("readyReplicas") or 0),
                        ready_pods=tuple(sorted(ready)),
                    )
                )
                scaler = status.get("autoscaler") or {}
                decision = scaler.get("decision") or {}
                key = f"{scaler.get('time')}|{decision}"
                if decision and key != seen_decision:
                    seen_decision = key
                    self.decisions.append(
                        ScalingDecision(
                            seen_at=now,
                            time=str(scaler.get("time")),
                            current=decision.get("currentReplicas"),
                            desired=decision.get("desiredReplicas"),
                            reason=str(decision.get("reason")),
                            formula=str(scaler.get("formula")),
                            inputs=dict(scaler.get("inputs") or {}),
                        )
                    )
            await asyncio.sleep(self.config.poll_interval_s)

    def _sync_pods(self, ready: dict[str, str]) -> None:
        for name in set(self._pods) - set(ready):
            del self._pods[name]
        for name, url in ready.items():
            pod = self._pods.get(name)
            if pod is None or pod.url != url:
                self._pods[name] = _Pod(url)

    def _pick(self) -> tuple[str, _Pod] | None:
        if self.via is not None:
            if self._via_pod is None:
                self._via_pod = _Pod(self.via)
            return "router", self._via_pod
        now = time.monotonic()
        usable = [(name, pod) for name, pod in self._pods.items() if pod.skip_until <= now]
        if not usable:
            return None
        return min(usable, key=lambda item: item[1].outstanding)

    async def _client(self) -> None:
        while True:
            picked = self._pick()
            if picked is None:
                await asyncio.sleep(0.2)  # no ready pod yet (or all just failed)
                continue
            name, pod = picked
            pod.outstanding += 1
            try:
                record = await self._request(name, pod.url)
            finally:
                pod.outstanding -= 1
            self.completions.append(record)
            if record.error is not None and self.via is None:
                pod.skip_until = time.monotonic() + ERROR_COOLDOWN_S
                await asyncio.sleep(0.1)

    async def _request(self, name: str, url: str) -> Completion:
        body = {
            "model": self.config.model,
            "prompt": self.config.prompt,
            "max_tokens": self.config.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        assert self._http is not None
        sent = time.monotonic()
        first: float | None = None
        chunks = 0
        try:
            async with self._http.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:200]
                    return Completion(
                        name, sent, None, time.monotonic() - sent, 0, f"HTTP {response.status_code}: {text}"
                    )
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if first is None:
                            first = time.monotonic() - sent
        except httpx.HTTPError as error:
            return Completion(
                name, sent, first, time.monotonic() - sent, chunks, f"{type(error).__name__}: {error}"
            )
        return Completion(name, sent, first, time.monotonic() - sent, chunks)


def ready_url(pod: dict[str, Any]) -> str | None:
    """``http://<podIP>:<port named http>`` for a Ready pod on a loopback IP not being deleted, drained or
    parked, else None."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not pod_is_ready(pod) or not ip or pod["metadata"].get("deletionTimestamp") or is_draining(pod) or is_parked(pod):
        return None  # as the router: nothing new to a pod being drained or parked in standby
    if not ipaddress.ip_address(ip).is_loopback:
        return None  # the loopback rule: load goes to 127.0.0.0/8 only, whatever the cluster says
    return f"http://{ip}:{named_port(pod, 'http', DEFAULT_PORT)}"
