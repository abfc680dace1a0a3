"""Replica discovery by watching an LLMService's pods and their readiness.

What it is: a list-then-watch loop over the pods selected by the LLMService
(its ``status.selector`` when the operator has set one, else
``app.kubernetes.io/instance=<name>,app.kubernetes.io/component=replica``), turning each pod into a replica URL
``http://<pod IP>:<port>`` whose readiness is the pod's Ready condition.

Each pod's ``plimsoll.dev/variant`` label and the LLMService's
``status.variants.<name>.weight`` and ``.rate`` (read with the status) weigh the replicas of a
service with hardware variants by their measured capacity.

What it is not: EndpointSlice-based. The API server rejects loopback addresses
in EndpointSlices, and test pods here run on 127.0.0.0/8, so pods are the one
source that works both here and in a cluster.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from plimsoll.pods import named_port, pod_is_ready
from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import RouterConfig

log = logging.getLogger(__name__)


# Set by the operator on replicas its scale-down is draining: no new requests go there.
DRAINING_LABEL = "plimsoll.dev/draining"
# A split fleet's pool of each replica (prefill or decode), set by the operator (spec.disaggregation).
ROLE_LABEL = "plimsoll.dev/role"
# An LLMService's hardware variant a replica belongs to; status.variants.<name>.weight is what one
# replica of it carries (operator/resources/variants.py), the weight the router gives it.
VARIANT_LABEL = "plimsoll.dev/variant"
# Set by the operator on replicas parked asleep (autoscaling.standby): nothing goes there either.
STANDBY_LABEL = "plimsoll.dev/standby"
# How often the LLMService's status is read (the hold queue takes the measured cold starts from it).
STATUS_POLL_S = 5.0


def variant_weights(status: dict[str, Any], key: str = "weight") -> dict[str, float]:
    """Per variant, what the operator measured: ``status.variants.<name>.weight`` (in-flight at its
    target) or, with ``key="rate"``, ``.rate`` (requests/s one replica finishes there)."""
    out = {}
    for name, entry in (status.get("variants") or {}).items():
        weight = (entry or {}).get(key)
        if isinstance(weight, int | float) and weight > 0:
            out[str(name)] = float(weight)
    return out


def is_draining(pod: dict[str, Any]) -> bool:
    """Marked for removal: routed nothing new."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(DRAINING_LABEL) == "true"


def is_parked(pod: dict[str, Any]) -> bool:
    """Parked in standby: routed nothing unless this router wakes it (router/standby_wake.py)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(STANDBY_LABEL) == "true"


def pod_endpoint(pod: dict[str, Any], default_port: int) -> tuple[str, bool] | None:
    """(replica URL, ready) for a pod in API JSON form, or None if it cannot take traffic at all."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or metadata.get("deletionTimestamp"):
        return None  # not scheduled yet, or terminating: route nothing new to it
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{named_port(pod, 'http', default_port)}", pod_is_ready(pod)


class PodDiscovery:
    """Keeps a ReplicaSet equal to the ready-or-not pods of one LLMService."""

    def __init__(
        self,
        config: RouterConfig,
        replica_set: ReplicaSet,
        on_status: Callable[[dict[str, Any]], None] | None = None,
        role: str | None = None,
    ) -> None:
        assert config.llmservice is not None
        self._on_status = on_status
        self._role = role  # only the pods of this pool of a split fleet (their ROLE_LABEL)
        self._config = config
        self._name = config.llmservice
        self._replica_set = replica_set
        # pod name -> URL, so a DELETED event can be mapped back even without its IP.
        self._pods: dict[str, str] = {}
        # URL -> the pod's hardware variant, and each variant's weight from the LLMService's status.
        self._variants: dict[str, str] = {}
        self._weights: dict[str, float] = {}
        self._rates: dict[str, float] = {}

    async def run(self) -> None:
        from kubernetes_asyncio import client, config, watch
        from kubernetes_asyncio.client.exceptions import ApiException

        if self._config.kubeconfig is not None:
            await config.load_kube_config(config_file=self._config.kubeconfig)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]  # the router's own pod: its ServiceAccount token
        else:
            await config.load_kube_config()  # $KUBECONFIG or ~/.kube/config
        async with client.ApiClient() as api_client:
            core = client.CoreV1Api(api_client)
            poller = asyncio.create_task(self._poll_status(client.CustomObjectsApi(api_client)))
            try:
                while True:
                    try:
                        selector = await self._selector(client.CustomObjectsApi(api_client))
                        pods = await core.list_namespaced_pod(self._config.namespace, label_selector=selector)
                        self._replace([api_client.sanitize_for_serialization(p) for p in pods.items])
                        stream = watch.Watch().stream(
                            core.list_namespaced_pod, self._config.namespace, label_selector=selector,
                            resource_version=pods.metadata.resource_version, timeout_seconds=300,
                        )
                        async with stream as events:
                            async for event in events:
                                self._apply(event["type"], event["raw_object"])
                    except ApiException as exc:
                        # 410 Gone (watch too old) and transient API errors: list again.
                        log.warning("pod watch for LLMService %s: %s; re-listing", self._name, exc.reason)
                        await asyncio.sleep(1.0)
            finally:
                poller.cancel()

    async def _poll_status(self, custom: Any) -> None:
        """Hand the LLMService's status to ``on_status`` every STATUS_POLL_S."""
        from kubernetes_asyncio.client.exceptions import ApiException

        while self._on_status is not None:
            try:
                service = await custom.get_namespaced_custom_object(
                    self._config.crd_group, self._config.crd_version, self._config.namespace, "llmservices",
                    self._name,
                )
                status = dict(service.get("status") or {})
                self._on_status(status)
                self.take_weights(status)
            except ApiException as exc:
                log.debug("cannot read LLMService %s status: %s", self._name, exc.reason)
            await asyncio.sleep(STATUS_POLL_S)

    async def _selector(self, custom: Any) -> str:
        from kubernetes_asyncio.client.exceptions import ApiException

        if self._role:
            # A split service's pools have a selector each (the prefill pool is its own Deployment); both
            # carry the service's instance label and their role.
            return f"app.kubernetes.io/instance={self._name},{ROLE_LABEL}={self._role}"

        # The router's own pods share the instance label; only replicas are wanted.
        fallback = f"app.kubernetes.io/component=replica,app.kubernetes.io/instance={self._name}"
        try:
            service = await custom.get_namespaced_custom_object(
                self._config.crd_group, self._config.crd_version, self._config.namespace, "llmservices", self._name
            )
        except ApiException as exc:
            log.warning("cannot read LLMService %s/%s (%s); selecting pods by %s",
                        self._config.namespace, self._name, exc.reason, fallback)
            return fallback
        selector = (service.get("status") or {}).get("selector")
        return selector if isinstance(selector, str) and selector else fallback

    def take_weights(self, status: dict[str, Any]) -> None:
        """Weigh each replica by its variant's measured capacity (status.variants; others 1.0)."""
        self._weights, self._rates = variant_weights(status), variant_weights(status, "rate")
        self._reweigh()

    def _reweigh(self) -> None:
        replicas = self._replica_set.replicas.values()
        if self._weights or any(r.weight != 1.0 or r.rate is not None for r in replicas):
            self._replica_set.set_weights(
                {url: self._weights.get(v, 1.0) for url, v in self._variants.items()},
                {url: self._rates[v] for url, v in self._variants.items() if v in self._rates},
            )

    def _note_variant(self, url: str, pod: dict[str, Any]) -> None:
        variant = ((pod.get("metadata") or {}).get("labels") or {}).get(VARIANT_LABEL)
        if variant:
            self._variants[url] = str(variant)
        else:
            self._variants.pop(url, None)

    def _replace(self, pods: list[dict[str, Any]]) -> None:
        self._pods.clear()
        self._variants.clear()
        ready: dict[str, bool] = {}
        draining: list[str] = []
        parked: list[str] = []
        for pod in pods:
            endpoint = pod_endpoint(pod, self._config.backend_port)
            if endpoint is not None:
                self._pods[pod["metadata"]["name"]] = endpoint[0]
                ready[endpoint[0]] = endpoint[1]
                self._note_variant(endpoint[0], pod)
                if is_draining(pod):
                    draining.append(endpoint[0])
                if is_parked(pod):
                    parked.append(endpoint[0])
        self._replica_set.replace(ready, ready, draining, parked)
        for name, url in self._pods.items():
            self._replica_set.replicas[url].pod = name
        self._reweigh()

    def _apply(self, event_type: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        endpoint = None if event_type == "DELETED" else pod_endpoint(pod, self._config.backend_port)
        old_url = self._pods.pop(name, None)
        if endpoint is None:
            if old_url is not None:
                self._replica_set.remove(old_url)
                self._variants.pop(old_url, None)
            return
        url, ready = endpoint
        if old_url is not None and old_url != url:
            self._replica_set.remove(old_url)
            self._variants.pop(old_url, None)
        self._pods[name] = url
        self._note_variant(url, pod)
        self._replica_set.upsert(url, ready, draining=is_draining(pod), parked=is_parked(pod))
        self._replica_set.replicas[url].pod = name
        self._reweigh()
