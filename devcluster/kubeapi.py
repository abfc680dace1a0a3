"""A small async client for the few API calls the pod runner makes, over httpx.

Reads an admin kubeconfig with embedded certificates (as ``pki.write_kubeconfig``
writes it). Lists and watches pods, patches pod status, deletes pods, posts
Events, reads ConfigMaps/Secrets, requests ServiceAccount tokens, and GETs an
object or list by path (the load recorder in ``podload.py``). It is not a
general Kubernetes client; the operator uses kopf and kubernetes_asyncio.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml


class KubeAPIError(RuntimeError):
    """A request the API server refused; carries the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"API server answered {status}: {message}")


def _ssl_context(kubeconfig: Path) -> tuple[str, ssl.SSLContext]:
    config = yaml.safe_load(kubeconfig.read_text())
    ctx_name = config["current-context"]
    context = next(c["context"] for c in config["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
    ctx = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    # ssl loads client certificates from files only; keep them in a private temp dir just long enough.
    with tempfile.TemporaryDirectory() as tmp:
        crt, key = Path(tmp) / "c.crt", Path(tmp) / "c.key"
        crt.write_bytes(base64.b64decode(user["client-certificate-data"]))
        key.touch(mode=0o600)
        key.write_bytes(base64.b64decode(user["client-key-data"]))
        ctx.load_cert_chain(str(crt), str(key))
    return str(cluster["server"]), ctx


class KubeAPI:
    """Async calls against one API server."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.server, ctx = _ssl_context(kubeconfig)
        self._client = httpx.AsyncClient(base_url=self.server, verify=ctx, timeout=httpx.Timeout(30.0))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        r = await self._client.request(method, path, **kwargs)
        if r.status_code >= 400:
            raise KubeAPIError(r.status_code, r.text[:500])
        return r.json() if r.content else None

    async def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        """GET one API path (an object or a list) as JSON."""
        return await self._request("GET", path, params=params)

    async def list_pods(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("GET", "/api/v1/pods")
        return result

    async def watch_pods(self, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        """Yield watch events (``{"type", "object"}``) until the server closes the stream."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "300",
        }
        async with self._client.stream(
            "GET", "/api/v1/pods", params=params, timeout=httpx.Timeout(30.0, read=330.0)
        ) as r:
            if r.status_code >= 400:
                raise KubeAPIError(r.status_code, (await r.aread()).decode()[:500])
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def patch_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def delete_pod_now(self, namespace: str, name: str, uid: str) -> None:
        """Delete with grace 0 once the process stopped, as a kubelet does; only this UID."""
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": uid},
        }
        try:
            await self._request(
                "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", content=json.dumps(body)
            )
        except KubeAPIError as exc:
            if exc.status not in (404, 409):  # already gone, or a new pod of the same name
                raise

    async def post_event(self, pod: dict[str, Any], kind: str, reason: str, message: str, now: str) -> None:
        meta = pod["metadata"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": kind,
            "reason": reason,
            "message": message,
            "source": {"component": "plimsoll-pod-runner", "host": pod["spec"].get("nodeName", "")},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._request(
            "POST", f"/api/v1/namespaces/{meta['namespace']}/events", content=json.dumps(event)
        )

    async def get_data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        """A ConfigMap's or Secret's data (Secret values decoded), or None if it does not exist."""
        plural = "secrets" if kind == "Secret" else "configmaps"
        try:
            obj = await self._request("GET", f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        except KubeAPIError as exc:
            if exc.status == 404:
                return None
            raise
        data = obj.get("data") or {}
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in data.items()}
        return {k: str(v) for k, v in data.items()}

    async def service_account_token(self, namespace: str, sa: str, audience_seconds: int = 86400) -> str:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": audience_seconds},
        }
        result = await self._request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token", content=json.dumps(body)
        )
        return str(result["status"]["token"])

    def token_kubeconfig(self, token: str, namespace: str) -> str:
        """Kubeconfig text for a pod's ServiceAccount token (what in-cluster config would give it)."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "in-cluster", "cluster": cluster}],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "in-cluster",
                        "context": {"cluster": "in-cluster", "user": "sa", "namespace": namespace},
                    }
                ],
                "current-context": "in-cluster",
            }
        )
