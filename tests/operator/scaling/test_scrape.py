"""The replica-planning handler's scrape path over real HTTP on 127.0.0.1, without a cluster.

Pods are the dicts the API server returns; their ``podIP`` and ``http`` port
point at real Prometheus exposition servers (prometheus_client) on loopback.
"""

import socket
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import MetricsHandler

from plimsoll import metric_names as names
from plimsoll.operator.handlers.pods import metrics_url
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.handlers.replica_planning import observe_pods
from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig
from plimsoll.operator.scaling.planner import decision_conditions


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def replica(running: int, waiting: int) -> type[BaseHTTPRequestHandler]:
    registry = CollectorRegistry()
    Gauge(names.NUM_REQUESTS_RUNNING, "r", registry=registry).set(running)
    Gauge(names.NUM_REQUESTS_WAITING, "w", registry=registry).set(waiting)
    return MetricsHandler.factory(registry)


class NotMetrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def pod(name: str, port: int, ready: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, **extra.get("metadata", {})},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "phase": extra.get("phase", "Running"),
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


MARKED = {"labels": {"plimsoll.dev/draining": "true"}}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def servers() -> Iterator[dict[str, int]]:
    started = {"a": serve(replica(6, 7)), "b": serve(replica(6, 8)), "html": serve(NotMetrics)}
    yield {k: port for k, (_, port) in started.items()}
    for server, _ in started.values():
        server.shutdown()
        server.server_close()


async def test_observe_scrapes_ready_pods_and_explains_failures(servers: dict[str, int]) -> None:
    pods = [
        pod("a", servers["a"]),
        pod("b", servers["b"]),
        pod("starting", servers["a"], ready=False),
        pod("html", servers["html"]),
        pod("gone", closed_port()),
        pod("deleting", servers["a"], metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}),
        pod("failed", servers["a"], phase="Failed"),
        pod(
            "leaving",
            servers["b"],
            ready=False,
            metadata=MARKED | {"deletionTimestamp": "2026-01-01T00:00:00Z"},
        ),
        pod("drained", servers["b"], ready=False, metadata=MARKED),
    ]
    async with httpx.AsyncClient() as http:
        observed = await observe_pods(ReplicaClient(http), pods)
    seen = {o.name: o for o in observed if o is not None}
    # Deleted and failed pods do not count; marked ones are scraped whether Ready or not (a drain
    # waits for them to empty, and reads what their shutdown cut until they are gone).
    assert set(seen) == {"a", "b", "starting", "html", "gone", "leaving", "drained"}
    assert seen["leaving"].terminating and seen["leaving"].draining and seen["leaving"].sample is not None
    assert not seen["drained"].terminating and seen["drained"].sample is not None
    assert not any(o.terminating for n, o in seen.items() if n != "leaving")
    seen = {n: o for n, o in seen.items() if n not in ("leaving", "drained")}
    assert seen["a"].sample is not None and seen["a"].sample.in_flight == 13
    assert seen["b"].sample is not None and seen["b"].sample.in_flight == 14
    assert not seen["starting"].ready and seen["starting"].sample is None
    assert (
        seen["html"].ready
        and seen["html"].sample is None
        and "not Prometheus text" in (seen["html"].error or "")
    )
    assert seen["gone"].ready and seen["gone"].error is not None and "Connect" in seen["gone"].error

    # The observations drive the decision exactly as the daemon does.
    scaler = Autoscaler(
        AutoscalerConfig(target_per_replica=6, min_replicas=1, max_replicas=10, scale_up_window_s=0)
    )
    d = scaler.decide(100.0, 2, list(seen.values()))
    assert (
        d.ready_pods == ("a", "b") and d.missing_pods == ("gone", "html") and d.unready_pods == ("starting",)
    )
    # Scale-up: silent and unready pods count as idle: (13 + 14 + 0 + 0 + 0) over 5 pods.
    assert d.formula == "ceil(5 × 5.4 / 6) = 5"
    assert d.to_status()["formula"] == d.formula
    kinds = {c[0]: (c[1], c[2]) for c in decision_conditions(d, ("Unknown", "NotEnoughTraffic", "quiet"))}
    assert kinds == {
        "ScalingLimited": ("False", "DesiredWithinRange"),
        "SLOAtRisk": ("Unknown", "NotEnoughTraffic"),
    }


def test_metrics_url_uses_the_named_port_or_8000() -> None:
    assert metrics_url(pod("a", 9000)) == "http://127.0.0.1:9000/metrics"
    bare = pod("a", 1)
    bare["spec"]["containers"][0]["ports"] = []
    assert metrics_url(bare) == "http://127.0.0.1:8000/metrics"
    del bare["status"]["podIP"]
    assert metrics_url(bare) is None
