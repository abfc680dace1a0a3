"""Engines for kwok-simulated replica pods: real Prometheus exposition on each pod's loopback IP.

:class:`SimulatedEngines` serves the runtime's running/waiting gauges on every
ready pod's ``<podIP>:8000/metrics`` and sets them from a total load the test
controls, shared evenly over the pods that take new work (a pod marked
``plimsoll.dev/draining`` gets no new work, as behind the router, and holds 0).
Used as a context manager it follows the pods every 0.5 s on a thread; a test
that wants the gauges exact at a moment calls :meth:`sync` itself instead.
"""

import threading
from http.server import ThreadingHTTPServer
from typing import Any

from llms_k8s import get_json
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import MetricsHandler

from plimsoll import metric_names as names
from plimsoll.operator.resources.settings import ENGINE_PORT


class SimulatedEngines:
    """Serves engine gauges on every ready pod's IP; `total` in-flight requests are shared evenly."""

    def __init__(self, cluster: Any, namespace: str, name: str, running_cap: int = 4) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.running_cap = running_cap
        self.total = 0.0
        self._servers: dict[str, tuple[ThreadingHTTPServer, Gauge, Gauge]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "SimulatedEngines":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        for server, _, _ in self._servers.values():
            server.shutdown()
            server.server_close()
        self._servers.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sync()
            self._stop.wait(0.5)

    def sync(self) -> None:
        listing = get_json(
            self.cluster, "pods", "-n", self.namespace, "-l", f"plimsoll.dev/llmservice={self.name}"
        )
        ips = set()
        # Pods the two-phase scale-down is draining get no new work (as behind the router): their share is 0.
        draining = set()
        for pod in (listing or {}).get("items", []):
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in pod.get("status", {}).get("conditions") or []
            )
            ip = pod.get("status", {}).get("podIP")
            if ready and ip and not pod["metadata"].get("deletionTimestamp"):
                ips.add(ip)
                if (pod["metadata"].get("labels") or {}).get("plimsoll.dev/draining") == "true":
                    draining.add(ip)
        for ip in set(self._servers) - ips:
            server, _, _ = self._servers.pop(ip)
            server.shutdown()
            server.server_close()
        for ip in ips - set(self._servers):
            registry = CollectorRegistry()
            running = Gauge(names.NUM_REQUESTS_RUNNING, "running", registry=registry)
            waiting = Gauge(names.NUM_REQUESTS_WAITING, "waiting", registry=registry)
            server = ThreadingHTTPServer((ip, ENGINE_PORT), MetricsHandler.factory(registry))
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers[ip] = (server, running, waiting)
        serving = [ip for ip in self._servers if ip not in draining]
        if serving:
            share = self.total / len(serving)
            for ip, (_, running, waiting) in self._servers.items():
                mine = share if ip in serving else 0.0
                running.set(min(mine, self.running_cap))
                waiting.set(max(mine - self.running_cap, 0.0))

    def close(self) -> None:
        """Stop every server (for a test that called :meth:`sync` itself)."""
        self.__exit__()

    @property
    def serving(self) -> list[str]:
        return sorted(self._servers)
