"""A small async Kubernetes client for the handlers: get, list, create, apply, patch, delete.

Built on kubernetes_asyncio's ApiClient (which handles kubeconfig, in-cluster
service-account tokens and client certificates) but speaks to generic REST paths,
so one ``apply()`` serves Deployments, Services, PDBs and the Prometheus Operator
kinds alike. Server-side apply with a single field manager is what makes
reconcile idempotent: re-applying the same object is a no-op, and a field someone
edited by hand is put back. Every handler reaches the API server through
:class:`Kube`; none builds its own kubernetes_asyncio API object. This is not a
cache or an informer, and it does not decide how status is merged
(``status_writer.py`` does).
"""

import os
import time
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

FIELD_MANAGER = "plimsoll-operator"

# apiVersion/kind -> plural, for the kinds the operator writes.
PLURALS = {
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "DaemonSet"): "daemonsets",
    ("v1", "Service"): "services",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
    ("plimsoll.dev/v1alpha1", "LLMService"): "llmservices",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("batch/v1", "Job"): "jobs",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
}


def contains(desired: Any, actual: Any) -> bool:
    """Whether ``actual`` holds everything in ``desired``: maps may have extra keys (server
    defaults), lists must have the same length and match item by item."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(v, actual[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list) and len(desired) == len(actual) and all(map(contains, desired, actual))
        )
    if isinstance(desired, bool) or isinstance(actual, bool):
        return desired is actual
    if (isinstance(desired, int) and isinstance(actual, str)) or (
        isinstance(desired, str) and isinstance(actual, int)
    ):
        return str(desired) == str(actual)  # quantities: 1 vs "1"
    return bool(desired == actual)


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """The REST path of a namespaced object (or its collection when ``name`` is None)."""
    plural = PLURALS[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


@dataclass
class Kube:
    """One ApiClient shared by every handler of the operator process."""

    api: client.ApiClient
    _discovery: dict[str, tuple[float, set[str]]]

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> "Kube":
        """Load ``kubeconfig`` when given, else in-cluster credentials inside a pod, else $KUBECONFIG."""
        configuration = client.Configuration()
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return cls(api=client.ApiClient(configuration), _discovery={})

    async def close(self) -> None:
        await self.api.close()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        result = await self.api.call_api(
            path,
            method,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            response_types_map={200: "object", 201: "object", 202: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _request_timeout=30,
        )
        return result if isinstance(result, dict) else {}

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call("GET", object_path(api_version, kind, namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` as the operator's field manager, taking over conflicting fields."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return await self._call(
            "PATCH",
            path,
            body=obj,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete the object (its dependents in the background); False when it did not exist."""
        try:
            await self._call(
                "DELETE",
                object_path(api_version, kind, namespace, name),
                query=[("propagationPolicy", "Background")],
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    async def replace_lists(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch ``obj``'s spec, which replaces every list in it whole.

        Server-side apply merges list-maps (Service ports, tolerations) by key, so an
        entry someone else added stays; when that leaves the object off its spec,
        this puts the lists back exactly as built.
        """
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return await self._call(
            "PATCH",
            path,
            body={"spec": obj["spec"]},
            query=[("fieldManager", FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    async def list_objects(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The objects of ``kind`` in ``namespace`` (matching ``label_selector`` when given)."""
        query = [("labelSelector", label_selector)] if label_selector else []
        listing = await self._call("GET", object_path(api_version, kind, namespace), query=query)
        items: list[dict[str, Any]] = listing.get("items", [])
        return items

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST ``obj``; the API server answers 409 when it already exists."""
        meta = obj["metadata"]
        return await self._call(
            "POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj
        )

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge-patch the object (a ``metadata.resourceVersion`` in ``patch`` is a precondition:
        the API server answers 409 when the object changed since that version)."""
        return await self._call(
            "PATCH",
            object_path(api_version, kind, namespace, name),
            body=patch,
            query=[("fieldManager", FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    async def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch the status subresource (lists such as conditions are replaced whole).

        With ``resource_version`` the patch only applies to that version of the object
        (409 otherwise). Handlers write LLMService status through ``status_writer.py``,
        which re-reads and merges first.
        """
        path = object_path(api_version, kind, namespace, name) + "/status"
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._call(
            "PATCH",
            path,
            body=body,
            query=[("fieldManager", FIELD_MANAGER)],
            content_type="application/merge-patch+json",
        )

    async def has_resource(self, group_version: str, plural: str, ttl: float | None = None) -> bool:
        """Whether the API server serves ``plural`` in ``group_version`` (discovery, cached for ``ttl``
        seconds, default $PLIMSOLL_DISCOVERY_TTL_SECONDS or 300)."""
        ttl = float(os.environ.get("PLIMSOLL_DISCOVERY_TTL_SECONDS", "300")) if ttl is None else ttl
        cached = self._discovery.get(group_version)
        if cached is None or time.monotonic() - cached[0] > ttl:
            try:
                listing = await self._call("GET", f"/apis/{group_version}")
                names = {r.get("name", "") for r in listing.get("resources", [])}
            except ApiException as error:
                if error.status not in (404, 403):
                    raise
                names = set()
            cached = (time.monotonic(), names)
            self._discovery[group_version] = cached
        return plural in cached[1]

    def forget_resources(self, group_version: str) -> None:
        """Drop the cached discovery of ``group_version`` (its CRD went away since it was read)."""
        self._discovery.pop(group_version, None)
