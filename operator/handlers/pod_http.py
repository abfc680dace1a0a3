"""Every HTTP call the operator's replica loop makes to a pod, in one place.

What it is: the calls, each with its timeout and what a failure means —
:func:`scrape` (a replica's ``/metrics``, parsed), :func:`hold` (the router's
``GET /hold``), :func:`answers_ready` (``GET /ready``), :func:`mark_for_removal`
and :func:`unmark` (``POST`` / ``DELETE /drain``), :func:`put_slo`
(``PUT /slo``), :func:`sleep` and :func:`wake_up` (sleep mode, a parked standby
replica). Callers pass a :class:`ReplicaClient` (one per LLMService
tick): every answer byte-capped, the LLMService's admin key on control calls.

What it is not: a decision about which pod to call (``scaling/planner.py`` and
``replica_planning.py`` decide) or a reader of the API server.
"""

import asyncio
import contextlib
from typing import Any

import httpx

from plimsoll.bounded_http import SMALL_LIMIT_BYTES
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.scaling.metrics import MetricsError, PodSample, parse_scrape
from plimsoll.operator.scaling.observations import RouterDemand

TIMEOUT_S = 2.0
# A level-2 wake reads the weights again; a level-1 sleep copies them to host memory.
SLEEP_TIMEOUT_S = 60.0


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def scrape(http: ReplicaClient, url: str) -> PodSample | str:
    """One pod's parsed metrics, or the reason they could not be read."""
    try:
        return parse_scrape(await http.get_text(url, timeout=TIMEOUT_S))
    except (httpx.HTTPError, MetricsError) as error:
        return _why(error)


async def hold(http: ReplicaClient, urls: list[str]) -> RouterDemand | None:
    """Every router pod's ``GET /hold`` (held requests and refusals add up over them; the oldest wait is
    the longest); None when none answers."""
    answers = await asyncio.gather(*(_hold_one(http, url) for url in urls))
    found = [(url, a) for url, a in zip(urls, answers, strict=True) if a is not None]
    if not found:
        return None
    waits = [float(w) for _, a in found if isinstance(w := a.get("oldestHeldSeconds"), int | float)]
    shed = [float(v) for _, a in found if isinstance(v := a.get("shedSloTotal"), int | float)]
    refused = {
        url: {
            str(k): float(v) for k, v in (a.get("refusedTotal") or {}).items() if isinstance(v, int | float)
        }
        for url, a in found
        if isinstance(a.get("refusedTotal"), dict)
    }
    woken: dict[str, float] = {}
    for _, a in found:
        for pod, since in (a.get("wokenStandby") or {}).items() if isinstance(a.get("wokenStandby"), dict) else ():
            if isinstance(since, int | float) and not isinstance(since, bool):
                woken[str(pod)] = min(float(since), woken.get(str(pod), float("inf")))
    return RouterDemand(
        held=sum(int(a.get("held") or 0) for _, a in found),
        oldest_held_s=max(waits) if waits else None,
        shed_slo_total=sum(shed) if shed else None,
        refused=refused,
        woken=woken,
    )


async def _hold_one(http: ReplicaClient, url: str) -> dict[str, Any] | None:
    try:
        demand: dict[str, Any] = await http.get_json(url, limit=SMALL_LIMIT_BYTES, timeout=TIMEOUT_S)
    except (httpx.HTTPError, ValueError):
        return None
    return demand if isinstance(demand, dict) else None


async def answers_ready(http: ReplicaClient, base_url: str) -> bool:
    """``GET /ready`` answers 200: the replica takes new work (a marked one answers 503)."""
    try:
        response = await http.request("GET", f"{base_url}/ready", SMALL_LIMIT_BYTES, timeout=TIMEOUT_S)
        return response.status_code == 200
    except httpx.HTTPError:
        return False


async def mark_for_removal(http: ReplicaClient, base_url: str) -> None:
    """``POST /drain``: the replica's readiness drops, in-flight work finishes (vLLM: 404, ignored)."""
    # Unanswered: the next tick asks /ready again and repeats it.
    with contextlib.suppress(httpx.HTTPError):
        await http.post(f"{base_url}/drain", timeout=TIMEOUT_S)


async def unmark(http: ReplicaClient, base_url: str) -> bool:
    """``DELETE /drain``; True when the replica answered (any status: vLLM has no /drain)."""
    try:
        await http.delete(f"{base_url}/drain", timeout=TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return True


async def sleep(http: ReplicaClient, base_url: str, level: int) -> str | None:
    """``POST /sleep?level=``: None once the replica sleeps, else why not yet (busy, loading, unreachable)."""
    try:
        response = await http.post(f"{base_url}/sleep?level={level}", timeout=SLEEP_TIMEOUT_S)
    except httpx.HTTPError as error:
        return _why(error)
    return None if response.status_code == 200 else f"{response.status_code}: {response.text[:200]}"


async def wake_up(http: ReplicaClient, base_url: str) -> bool:
    """``POST /wake_up``; True once the replica answered that it is awake."""
    try:
        response = await http.post(f"{base_url}/wake_up", timeout=SLEEP_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return bool(response.status_code == 200)


async def put_slo(http: ReplicaClient, base_url: str, objectives: dict[str, Any]) -> None:
    """``PUT /slo``: the bounds the replica judges each request against; raises httpx.HTTPError."""
    response = await http.put(f"{base_url}/slo", json=objectives, timeout=TIMEOUT_S)
    response.raise_for_status()
