"""On a shared cluster: objects the operator does not own stay untouched, and a replica cannot flood it.

The real operator (local process, the chart's RBAC) on the local control plane:

- a Service ``web``, a Deployment ``web`` and a Deployment ``web-router`` that someone
  else made stay byte for byte as they were when an LLMService ``web`` (router on) is
  created; it reports ``OwnershipConflict`` naming them (condition and Warning Event),
  still creates what is its own (the credentials Secret, the NetworkPolicy), and
  deleting it leaves the three objects in place;
- a "replica" that answers ``/metrics`` with 1 GiB (a server in this test, bound to the
  simulated pod's loopback IP) is read only up to the operator's byte cap: the operator
  stays alive, its peak memory barely moves, and it sends the admin key from the
  LLMService's Secret (and only there) when it lists the replica's adapters.
"""

import base64
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llms_k8s import SIMULATED, apply, condition, get_json, llmservice, wait_for, wait_for_passes

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420)]

GIB = 1 << 30
CHUNK = b"x" * (1 << 20)


def foreign_deployment(name: str) -> dict[str, Any]:
    labels = {"app": f"{name}-someone-else"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": SIMULATED},
                "spec": {"containers": [{"name": "app", "image": "registry.example/app:1"}]},
            },
        },
    }


FOREIGN_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web", "labels": {"app": "web-someone-else"}},
    "spec": {
        "selector": {"app": "web-someone-else"},
        "ports": [{"name": "www", "port": 80, "targetPort": 8080}],
    },
}


def _settled(cluster: Any, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    """The object once its controller has caught up (a Deployment's rollout done), else None."""
    obj = get_json(cluster, kind, name, "-n", ns)
    if obj is None or kind != "deployment":
        return obj
    status = obj.get("status") or {}
    done = (
        status.get("observedGeneration") == obj["metadata"]["generation"]
        and status.get("availableReplicas") == 1
    )
    return obj if done else None


def events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={name},involvedObject.kind=LLMService"
    return list((get_json(cluster, "events", "-n", ns, "--field-selector", selector) or {}).get("items", []))


def test_objects_of_the_same_name_stay_untouched_and_are_reported(
    devcluster: Any, llms_namespace: str, running_operator: Any
) -> None:
    ns = llms_namespace
    for manifest in (FOREIGN_SERVICE, foreign_deployment("web"), foreign_deployment("web-router")):
        apply(devcluster, ns, manifest)
    theirs = [("service", "web"), ("deployment", "web"), ("deployment", "web-router")]
    before = {
        key: wait_for(lambda key=key: _settled(devcluster, ns, *key), 90, f"{key} to settle")
        for key in theirs
    }
    apply(devcluster, ns, llmservice("web", router={"enabled": True}))

    def reported() -> dict[str, Any] | None:
        obj = get_json(devcluster, "llms", "web", "-n", ns)
        found = condition(obj, "OwnershipConflict")
        return found if found and found["status"] == "True" else None

    conflict = wait_for(reported, 90, "OwnershipConflict=True on the LLMService")
    for label in ("Deployment web,", "Service web,", "Deployment web-router"):
        assert label.rstrip(",") in conflict["message"], conflict
    assert conflict["reason"] == "ObjectNotOwned"
    ready = condition(get_json(devcluster, "llms", "web", "-n", ns), "Ready")
    assert ready is not None and ready["status"] == "False" and ready["reason"] == "OwnershipConflict"
    wait_for(
        lambda: [
            e
            for e in events(devcluster, ns, "web")
            if e["reason"] == "OwnershipConflict" and e["type"] == "Warning"
        ],
        60,
        "the OwnershipConflict Warning Event",
    )
    # Its own children are made all the same: the credentials Secret and the NetworkPolicy, owned by it.
    uid = get_json(devcluster, "llms", "web", "-n", ns)["metadata"]["uid"]
    for kind, name in (("secret", "web-admin-key"), ("networkpolicy", "web"), ("service", "web-router")):
        owned = wait_for(lambda k=kind, n=name: get_json(devcluster, k, n, "-n", ns), 60, f"{kind} {name}")
        assert [r["uid"] for r in owned["metadata"].get("ownerReferences", [])] == [uid], (
            kind,
            owned["metadata"],
        )
    # Two more full passes: nothing of theirs was adopted, applied, patched or deleted, and no retry storm.
    wait_for_passes(running_operator, "Timer 'resync_llmservice'", ns, "web", passes=2)
    for key in theirs:
        assert get_json(devcluster, *key, "-n", ns) == before[key], f"{key} changed"
    warnings = [e for e in events(devcluster, ns, "web") if e["reason"] == "OwnershipConflict"]
    assert sum(e.get("count", 1) for e in warnings) == 1, warnings
    secret_fields_are_added_never_rewritten(devcluster, ns, "web")

    devcluster.kubectl("delete", "llms", "web", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: get_json(devcluster, "networkpolicy", "web", "-n", ns) is None,
        90,
        "its own children collected",
    )
    for key in theirs:
        assert get_json(devcluster, *key, "-n", ns) == before[key], f"{key} changed when the LLMService went"


def test_a_pool_profile_never_takes_over_an_object_of_its_name(
    devcluster: Any, llms_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split service's pool profile goes through the same owned steps as any profile: a ServiceAccount of
    the profiler's name that someone else made is a conflict, left as it was, and no Job starts; without
    it, the Job starts labelled with its pool and every RBAC object is the service's own."""
    import asyncio

    import kopf

    from plimsoll.operator.api.llmservice import LLMService
    from plimsoll.operator.handlers.kube import Kube
    from plimsoll.operator.handlers.ownership import OwnershipConflict
    from plimsoll.operator.handlers.profiling import start_job
    from plimsoll.operator.resources.pools import profile_view
    from plimsoll.operator.resources.profile_job import profiler_account_name
    from plimsoll.operator.resources.settings import BuildSettings

    posted: list[tuple[str, str]] = []  # Events, outside kopf's own loop
    monkeypatch.setattr(kopf, "info", lambda _body, reason, message: posted.append((reason, message)))
    ns = llms_namespace
    pools = {"prefill": {"replicas": 1}, "decode": {}}
    apply(devcluster, ns, llmservice("split", replicas=1, disaggregation=pools))
    body = wait_for(lambda: get_json(devcluster, "llms", "split", "-n", ns), 30, "the LLMService")
    svc = LLMService.model_validate(body)
    account = profiler_account_name(svc)
    theirs = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": account, "labels": {"team": "b"}},
    }
    apply(devcluster, ns, theirs)
    before = get_json(devcluster, "serviceaccount", account, "-n", ns)

    async def start() -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The Job started, and as the API server holds it, read at once: the session's operator
        deletes a profile Job of another spec hash ("h1") on its next pass over this service."""
        kube = await Kube.connect(str(devcluster.kubeconfig))
        try:
            view = profile_view(svc, "prefill")
            job = await start_job(
                kube, body, view, BuildSettings(), "h1", "127.0.0.9", "test", role="prefill"
            )
            return job, await kube.get("batch/v1", "Job", ns, job["metadata"]["name"])
        finally:
            await kube.close()

    with pytest.raises(OwnershipConflict, match=account):
        asyncio.run(start())
    assert get_json(devcluster, "serviceaccount", account, "-n", ns) == before
    jobs = get_json(devcluster, "jobs", "-n", ns, "-l", "app.kubernetes.io/component=profile")["items"]
    assert jobs == []

    devcluster.kubectl("delete", "serviceaccount", account, "-n", ns)
    job, made = asyncio.run(start())
    assert made is not None, "the Job was created"
    assert made["metadata"]["labels"]["plimsoll.dev/role"] == "prefill"
    assert posted == [
        ("ProfilingStarted", f"Job {job['metadata']['name']} measures prefill replica 127.0.0.9 (test)")
    ]
    for kind in ("serviceaccount", "role", "rolebinding"):
        owners = get_json(devcluster, kind, account, "-n", ns)["metadata"].get("ownerReferences", [])
        assert [o["uid"] for o in owners] == [body["metadata"]["uid"]], (kind, owners)


def secret_fields_are_added_never_rewritten(devcluster: Any, ns: str, name: str) -> None:
    """The credentials Secret holds every field the pods read; one made before a field existed (here:
    the KV tier's password removed by hand) gets it back from the next check, the others unchanged."""
    import asyncio

    from plimsoll.operator.api.llmservice import LLMService
    from plimsoll.operator.handlers import credentials
    from plimsoll.operator.handlers.kube import Kube

    secret = f"{name}-admin-key"
    data = get_json(devcluster, "secret", secret, "-n", ns)["data"]
    assert set(data) == {"admin-api-key", "ray-auth-token", "kv-password", "wake-api-key"}
    devcluster.kubectl("patch", "secret", secret, "-n", ns, "--type=json",
                       "-p", '[{"op": "remove", "path": "/data/kv-password"}]')  # fmt: skip
    body = get_json(devcluster, "llms", name, "-n", ns)

    async def check() -> bool:
        kube = await Kube.connect(str(devcluster.kubeconfig))
        try:
            credentials._seen.clear()  # this process never saw it; the operator's own pass rechecks every 300 s
            return await credentials.ensure_credentials(kube, body, LLMService.model_validate(body))
        finally:
            await kube.close()

    assert asyncio.run(check()) is False  # not created: patched
    after = get_json(devcluster, "secret", secret, "-n", ns)["data"]
    assert set(after) == set(data) and after["kv-password"] != data["kv-password"]
    assert {k: after[k] for k in ("admin-api-key", "ray-auth-token")} == {
        k: data[k] for k in ("admin-api-key", "ray-auth-token")
    }


class FloodingReplica:
    """A raw HTTP server on a simulated pod's IP: ``/metrics`` streams 1 GiB, ``/v1/models`` records its
    Authorization header, everything else answers a small 200 JSON."""

    def __init__(self, ip: str, port: int = 8000) -> None:
        self.sock = socket.create_server((ip, port))
        self.sent_metrics: list[int] = []  # bytes of /metrics sent, per connection
        self.models_auth: list[str] = []
        self.metrics_auth: list[str] = []
        self.other_auth: list[tuple[str, str]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                more = conn.recv(65536)
                if not more:
                    return
                head += more
            line, *fields = head.split(b"\r\n\r\n")[0].decode(errors="replace").split("\r\n")
            path = line.split()[1]
            auth = next(
                (f.split(":", 1)[1].strip() for f in fields if f.lower().startswith("authorization:")), ""
            )
            if path == "/metrics":
                self.metrics_auth.append(auth)
                self._flood(conn)
                return
            if path == "/v1/models":
                self.models_auth.append(auth)
                body = json.dumps({"object": "list", "data": [{"id": "web", "object": "model"}]}).encode()
            else:
                self.other_auth.append((path, auth))
                body = b"{}"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

    def _flood(self, conn: socket.socket) -> None:
        sent = 0
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % GIB)  # fmt: skip
            while sent < GIB:
                conn.sendall(CHUNK)
                sent += len(CHUNK)
        except OSError:
            pass  # the reader hung up: what the cap is for
        self.sent_metrics.append(sent)

    def close(self) -> None:
        self.sock.close()


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture
def flooded(devcluster: Any, llms_namespace: str) -> Iterator[tuple[str, FloodingReplica]]:
    ns = llms_namespace
    manifest = llmservice("flood", autoscaling={"mode": "builtin", "intervalSeconds": 1},
                          scaling={"min": 1, "max": 1}, engine={"enableLora": True})  # fmt: skip

    apply(devcluster, ns, manifest)

    def pod_ip() -> str | None:
        pods = (get_json(devcluster, "pods", "-n", ns, "-l", "plimsoll.dev/llmservice=flood") or {}).get(
            "items", []
        )
        ready = [p for p in pods if (condition(p, "Ready") or {}).get("status") == "True"]
        return ready[0]["status"].get("podIP") if ready else None

    replica = FloodingReplica(wait_for(pod_ip, 120, "the simulated replica's pod IP"))
    try:
        yield ns, replica
    finally:
        replica.close()


def test_a_replica_streaming_1gib_of_metrics_is_cut_at_the_cap(
    devcluster: Any, flooded: tuple[str, FloodingReplica], running_operator: Any
) -> None:
    ns, replica = flooded
    assert running_operator.process is not None
    pid = running_operator.process.pid
    peak_before = _peak_rss_bytes(pid)
    # Three scrapes of the 1 GiB answer, each abandoned at the cap.
    wait_for(lambda: len(replica.sent_metrics) >= 3, 120, "three scrapes of the flooding replica")
    assert running_operator.is_alive()
    assert max(replica.sent_metrics) < 256 * (1 << 20), replica.sent_metrics  # the cap, plus socket buffers
    growth = _peak_rss_bytes(pid) - peak_before
    print(f"\n1 GiB /metrics: MiB sent before the operator hung up {[round(n / 2**20) for n in replica.sent_metrics]}, "
          f"operator peak RSS growth {growth / 2**20:.1f} MiB")  # fmt: skip
    assert growth < 128 * (1 << 20), f"operator peak RSS grew {growth / 2**20:.0f} MiB"
    # The operator's adapter sync lists the replica's adapters with the admin key from its Secret.
    secret = wait_for(
        lambda: get_json(devcluster, "secret", "flood-admin-key", "-n", ns), 60, "the credentials Secret"
    )
    key = base64.b64decode(secret["data"]["admin-api-key"]).decode()
    wait_for(lambda: replica.models_auth, 90, "a GET /v1/models from the operator")
    assert set(replica.models_auth) == {f"Bearer {key}"}
    assert set(replica.metrics_auth) == {""}, "the admin key goes to control and /v1 paths only"
