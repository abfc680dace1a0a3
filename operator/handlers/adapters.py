"""Keep every Ready replica's LoRA adapters in line with ``spec.adapters``, live, through the engine's API.

What it is: :func:`sync_adapters`, called by reconcile (create, update, resume, the
resync timer) and when the replicas' Deployment changes (a pod turned Ready). For each
Ready replica it reads ``GET /v1/models``, then ``POST /v1/unload_lora_adapter`` for
adapters no longer declared and ``POST /v1/load_lora_adapter`` for missing ones
(vLLM's endpoints and bodies; plimsoll serves the same), writes ``status.adapters``
(where each adapter is loaded, which pods refused it) and the ``AdaptersReady``
condition through the one status writer, and posts Events: Normal for loads and
unloads, Warning ``AdapterLoadFailed`` once per new refusal. A refused load is retried
on the next pass (every resync), never in a loop, and nothing restarts a pod.

What it is not: the decision of what to load (``resources/adapters.py``, pure) or the
pod template (adapters are not in it, so this is how they get onto pods at all).
"""

import asyncio
from typing import Any, cast

import httpx
import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import BodyLike, Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.pods import counts_for_scaling, list_pods, metrics_url, pod_is_ready
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status, with_conditions
from plimsoll.operator.resources.adapters import (
    PodAdapters,
    adapters_condition,
    adapters_status,
    desired_adapters,
    loaded_adapters,
    plan_pod,
)

LIST_TIMEOUT_S = 5.0
# Loading reads the adapter from disk and moves it to host memory; a large one takes a while.
LOAD_TIMEOUT_S = 60.0
# One pass at a time per LLMService: reconcile and a Deployment event may overlap, and two
# passes would load the same adapter twice (the second answered "already loaded").
_passes: dict[tuple[str, str], asyncio.Lock] = {}


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text.strip()[:300]}"
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else (body.get("message") if isinstance(body, dict) else None)
    return f"HTTP {response.status_code}: {message or response.text.strip()[:300]}"


async def sync_pod(
    http: ReplicaClient, base_url: str, pod: str, desired: dict[str, str], base_model: str, logger: Log
) -> tuple[PodAdapters, list[str], list[str]]:
    """Bring one replica to ``desired``; returns what it holds after, and the names loaded and unloaded."""
    try:
        held = loaded_adapters(await http.get_json(f"{base_url}/v1/models", timeout=LIST_TIMEOUT_S), base_model)
    except (httpx.HTTPError, ValueError) as error:
        return PodAdapters(pod=pod, error=f"{type(error).__name__}: {error}"[:300]), [], []
    plan = plan_pod(desired, held)
    names = set(held)
    unloaded: list[str] = []
    for name in plan.unload:
        try:
            answer = await http.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.HTTPError as error:
            logger.warning("unloading adapter %s on %s: %s (retried next pass)", name, pod, error)
            continue
        if answer.status_code in (200, 404):  # 404: already gone
            names.discard(name)
            unloaded.append(name)
        else:  # e.g. refused while requests use it: the next pass asks again
            logger.info("adapter %s on %s not unloaded yet: %s", name, pod, _error_message(answer))
    loaded: list[str] = []
    failed: list[tuple[str, str]] = []
    for name, path in plan.load:
        body = {"lora_name": name, "lora_path": path}
        try:
            answer = await http.post(f"{base_url}/v1/load_lora_adapter", json=body, timeout=LOAD_TIMEOUT_S)
        except httpx.HTTPError as error:
            failed.append((name, f"{type(error).__name__}: {error}"[:300]))
            continue
        if answer.status_code == 200:
            names.add(name)
            loaded.append(name)
        else:
            failed.append((name, _error_message(answer)[:300]))
    return PodAdapters(pod=pod, loaded=tuple(sorted(names)), failed=tuple(failed)), loaded, unloaded


def _failures(status: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (row.get("name", ""), f.get("pod", ""), f.get("message", ""))
        for row in status.get("adapters") or []
        for f in row.get("failures") or []
    }


async def sync_adapters(kube: Kube, body: BodyLike, svc: LLMService, logger: Log) -> None:
    """One pass over the Ready replicas (see the module docstring); quiet when LoRA is off and always was."""
    seen = dict(body.get("status") or {})
    if not svc.spec.lora_enabled() and not seen.get("adapters"):
        return
    ready = [
        (p["metadata"]["name"], url.removesuffix("/metrics"))
        for p in await list_pods(kube, svc)
        if counts_for_scaling(p) and pod_is_ready(p) and (url := metrics_url(p))
    ]
    desired = desired_adapters(svc) if svc.spec.lora_enabled() else {}
    lock = _passes.setdefault((svc.namespace, svc.name), asyncio.Lock())
    async with lock, httpx.AsyncClient(timeout=LIST_TIMEOUT_S) as raw:
        http = await ReplicaClient.for_service(kube, svc, raw)
        results = await asyncio.gather(
            *(sync_pod(http, url, pod, desired, svc.served_name, logger) for pod, url in sorted(ready))
        )
    pods = [r[0] for r in results]
    rows = adapters_status(svc, pods)
    condition = adapters_condition(svc, pods)

    def change(status: dict[str, Any]) -> dict[str, Any]:
        conditions = with_conditions(
            status.get("conditions"),
            (("AdaptersReady", condition.status, condition.reason, condition.message),),
            svc.metadata.generation,
        )
        return {"adapters": rows, "conditions": conditions}

    await update_status(kube, svc.namespace, svc.name, change, seen=seen)
    owner = cast(kopf.Body, body)
    loads = [f"{n} on {r[0].pod}" for r in results for n in r[1]]
    unloads = [f"{n} from {r[0].pod}" for r in results for n in r[2]]
    if loads:
        kopf.info(owner, reason="AdapterLoaded", message=("loaded " + ", ".join(loads))[:MAX_MESSAGE])
    if unloads:
        kopf.info(owner, reason="AdapterUnloaded", message=("unloaded " + ", ".join(unloads))[:MAX_MESSAGE])
    before = _failures(seen)
    new = [(n, p.pod, m) for p in pods for n, m in p.failed if (n, p.pod, m) not in before]
    if new:
        text = "; ".join(f"{n} on {pod}: {m}" for n, pod, m in new)
        logger.warning("adapter load refused: %s", text)
        kopf.warn(owner, reason="AdapterLoadFailed", message=text[:MAX_MESSAGE])
