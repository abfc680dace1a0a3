"""Writes llmservice.json, the chart's Grafana dashboard for LLMService replicas.

What it is: the source of the committed dashboard JSON. Six panels, the ones the
seed articles keep side by side (GPU utilisation and memory, request and token
throughput, TTFT/TPOT percentiles, queue length, KV-cache usage, timeouts and
errors), then the operator's SLO attainment and cost and one per priority class, filtered by the ``namespace`` and ``llmservice`` labels the operator's
PodMonitor puts on every replica series. Each query reads the ``plimsoll_*``
series or, through ``or``, vLLM's ``vllm:*`` equivalents (names from
plimsoll.metric_names), so one dashboard covers both engine kinds. GPU panels
read NVIDIA's DCGM exporter, joined to the LLMService's pods through ``up``.

What it is not: imported by the chart (Helm reads the JSON) or by the operator.
Run ``python charts/plimsoll/dashboards/generate.py`` after a
change and commit both files; a test fails when they drift apart.
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plimsoll import metric_names as mn
from plimsoll.metric_names import PLIMSOLL, VLLM

OUTPUT = Path(__file__).with_name("llmservice.json")
UID = "plimsoll-llmservice"
# The label the PodMonitor relabels from the pod's plimsoll.dev/llmservice label
# (operator/resources/monitoring.py SERIES_LABEL; a test holds the two together).
SERVICE_LABEL = "llmservice"
SEL = f'namespace="$namespace", {SERVICE_LABEL}=~"$llmservice"'
RATE = "$__rate_interval"
# The operator's per-LLMService series (operator/handlers/attainment.py).
ATTAINMENT = "plimsoll_operator_slo_attainment_ratio"
COST_PER_1K = "plimsoll_operator_replica_seconds_per_1k_good_requests"


def either(query: Callable[[str], str], plimsoll: str, vllm: str) -> str:
    """The same query over plimsoll's series, else vLLM's: whichever the replicas export."""
    return f"{query(plimsoll)} or {query(vllm)}"


def quantile(q: float, histogram: Callable[[Any], str]) -> str:
    return "histogram_quantile({q}, {inner})".format(
        q=q,
        inner=either(
            lambda name: f"sum by (le) (rate({name}_bucket{{{SEL}}}[{RATE}]))",
            histogram(PLIMSOLL),
            histogram(VLLM),
        ),
    )


def rate_sum(by: str = "") -> Callable[[str], str]:
    group = f" by ({by})" if by else ""
    return lambda name: f"sum{group} (rate({name}{{{SEL}}}[{RATE}]))"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }


def right_axis(pattern: str, unit: str) -> dict[str, Any]:
    """Series whose legend matches ``pattern`` drawn on a right-hand axis with their own unit."""
    return {
        "matcher": {"id": "byRegexp", "options": pattern},
        "properties": [
            {"id": "custom.axisPlacement", "value": "right"},
            {"id": "unit", "value": unit},
        ],
    }


def panel(
    index: int,
    title: str,
    description: str,
    unit: str,
    targets: list[tuple[str, str]],
    overrides: list[dict[str, Any]] | None = None,
    maximum: float | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "min": 0}
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        # Two panels a row, three rows.
        "gridPos": {"h": 9, "w": 12, "x": 12 * (index % 2), "y": 9 * (index // 2)},
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}
        },
        "targets": [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
    }


def gpu_panel() -> dict[str, Any]:
    # DCGM series carry the pod they are attached to; `and on (namespace, pod) up{…}`
    # keeps those of this LLMService's scraped replicas only.
    mine = f"and on (namespace, pod) up{{{SEL}}}"
    return panel(
        0,
        "GPU utilisation and memory",
        "DCGM exporter: GPU busy time (DCGM_FI_DEV_GPU_UTIL) and framebuffer memory in use "
        "(FB_USED / (FB_USED + FB_FREE)) per replica pod. Memory sits high by design (the KV "
        "cache is allocated up front); the KV-cache panel says how full it is.",
        "percent",
        [
            (f"avg by (pod) (DCGM_FI_DEV_GPU_UTIL {mine})", "{{pod}} utilisation"),
            (
                f"100 * sum by (pod) (DCGM_FI_DEV_FB_USED {mine}) / "
                f"sum by (pod) ((DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) {mine})",
                "{{pod}} memory used",
            ),
        ],
        maximum=100,
    )


def throughput_panel() -> dict[str, Any]:
    return panel(
        1,
        "Request and token throughput",
        "Finished requests per second (right axis) and prompt and generated tokens per second "
        "over all replicas.",
        "short",
        [
            (either(rate_sum(), PLIMSOLL.request_success, VLLM.request_success), "requests/s"),
            (either(rate_sum(), PLIMSOLL.prompt_tokens, VLLM.prompt_tokens), "prompt tokens/s"),
            (either(rate_sum(), PLIMSOLL.generation_tokens, VLLM.generation_tokens), "generated tokens/s"),
        ],
        overrides=[right_axis("requests/s", "reqps")],
    )


def latency_panel() -> dict[str, Any]:
    targets = []
    for q in (0.5, 0.95, 0.99):
        targets.append((quantile(q, lambda f: f.ttft), f"TTFT p{round(q * 100)}"))
    for q in (0.5, 0.95, 0.99):
        targets.append((quantile(q, lambda f: f.tpot), f"TPOT p{round(q * 100)}"))
    targets.append((quantile(0.95, lambda f: f.e2e), "end-to-end p95"))
    return panel(
        2,
        "TTFT and TPOT percentiles",
        "Time to first token and time per output token at p50/p95/p99, and end-to-end p95, "
        "from the replicas' histograms over all replicas. Watch p95/p99, not the mean: a "
        "healthy-looking mean hides a tail that breaks the SLO.",
        "s",
        targets,
    )


def queue_panel() -> dict[str, Any]:
    gauge = lambda name: f"sum by (pod) ({name}{{{SEL}}})"  # noqa: E731
    return panel(
        3,
        "Queue length",
        "Requests waiting to be scheduled and running in the batch, per replica. In-flight "
        "(running + waiting) per replica is what the autoscaler compares with the profiled "
        "target; a waiting queue that stays up means the replicas are past their knee.",
        "short",
        [
            (either(gauge, PLIMSOLL.waiting, VLLM.waiting), "{{pod}} waiting"),
            (either(gauge, PLIMSOLL.running, VLLM.running), "{{pod}} running"),
        ],
    )


def kv_panel() -> dict[str, Any]:
    return panel(
        4,
        "KV-cache usage",
        "Share of KV-cache blocks in use per replica (left), and per second (right) the "
        "preemptions and, on plimsoll, KV-block allocation failures. Usage near 100% with "
        "preemptions means the replica takes more concurrent work than its cache holds.",
        "percentunit",
        [
            (
                either(lambda n: f"max by (pod) ({n}{{{SEL}}})", PLIMSOLL.kv_usage, VLLM.kv_usage),
                "{{pod}} used",
            ),
            (either(rate_sum(), PLIMSOLL.preemptions, VLLM.preemptions), "preemptions/s"),
            (rate_sum()(mn.KV_CACHE_ALLOCATION_FAILURES), "allocation failures/s"),
        ],
        overrides=[right_axis("preemptions/s|allocation failures/s", "short")],
        maximum=1,
    )


def errors_panel() -> dict[str, Any]:
    failed = f'{SEL}, finished_reason=~"abort|error"'
    refused = f'{SEL}, reason=~"queue_full|draining|timeout"'
    p_fail = f"sum(rate({PLIMSOLL.request_success}{{{failed}}}[{RATE}]))"
    p_all = f"sum(rate({PLIMSOLL.request_success}{{{SEL}}}[{RATE}]))"
    p_refused = f"sum(rate({mn.ADMISSION_REJECTIONS}{{{refused}}}[{RATE}]))"
    v_fail = f"sum(rate({VLLM.request_success}{{{failed}}}[{RATE}]))"
    v_all = f"sum(rate({VLLM.request_success}{{{SEL}}}[{RATE}]))"
    return panel(
        5,
        "Timeouts and errors",
        "Share of requests that failed on the server's side (left): finished with abort or "
        "error, or (plimsoll) refused as queue full, draining or timed out. Right: refusals "
        "per second by reason (429 queue_full, 503 draining, timeout; 400 invalid_request is "
        "the client's) and failed finishes by reason.",
        "percentunit",
        [
            (
                f"({p_fail} + {p_refused}) / ({p_all} + {p_refused}) or {v_fail} / {v_all}",
                "error share",
            ),
            (rate_sum("reason")(mn.ADMISSION_REJECTIONS), "refused {{reason}}/s"),
            (
                either(
                    lambda n: f"sum by (finished_reason) (rate({n}{{{failed}}}[{RATE}]))",
                    PLIMSOLL.request_success,
                    VLLM.request_success,
                ),
                "{{finished_reason}}/s",
            ),
        ],
        overrides=[right_axis(".*/s", "reqps")],
        maximum=1,
    )


def slo_panel() -> dict[str, Any]:
    """From the operator's own metrics endpoint (its ServiceMonitor), not the replicas."""
    return panel(
        6,
        "SLO attainment and cost",
        "Share of finished requests that met every spec.slo bound (each applied per request, as "
        "bench does) over the last minute and hour, and replica-seconds spent per 1000 such "
        "requests over the hour (right). Written by the operator's built-in autoscaler; SLOAtRisk "
        "turns True when the 1-minute figure falls below 99%.",
        "percentunit",
        [
            (f'{ATTAINMENT}{{{SEL}, window="1m"}}', "{{llmservice}} attainment 1m"),
            (f'{ATTAINMENT}{{{SEL}, window="1h"}}', "{{llmservice}} attainment 1h"),
            (f"{COST_PER_1K}{{{SEL}}}", "{{llmservice}} replica-s per 1k good"),
        ],
        overrides=[right_axis(".*per 1k good", "s")],
        maximum=1,
    )


def priority_panel() -> dict[str, Any]:
    """One panel per priority class (Grafana repeats it over ``$priority``); plimsoll only."""
    cls = f'{SEL}, priority=~"$priority"'

    def pq(q: float, name: str) -> str:
        return f"histogram_quantile({q}, sum by (le) (rate({name}_bucket{{{cls}}}[{RATE}])))"

    body = panel(
        8,  # its own row: Grafana repeats it across
        "Priority class $priority",
        "With --scheduling-policy priority: time to first token and queue time of this class "
        "(lower priority value runs first), and its finished-request rate. Under overload the "
        "high class should keep its TTFT while the low classes absorb the queue.",
        "s",
        [
            (pq(0.5, mn.PRIORITY_TIME_TO_FIRST_TOKEN), "TTFT p50"),
            (pq(0.95, mn.PRIORITY_TIME_TO_FIRST_TOKEN), "TTFT p95"),
            (pq(0.95, mn.PRIORITY_REQUEST_QUEUE_TIME), "queue time p95"),
            (f"sum (rate({mn.PRIORITY_REQUESTS}{{{cls}}}[{RATE}]))", "requests/s"),
        ],
        overrides=[right_axis("requests/s", "reqps")],
    )
    body["repeat"] = "priority"
    body["repeatDirection"] = "h"
    body["maxPerRow"] = 2
    return body


def variables() -> list[dict[str, Any]]:
    # Any replica series names its namespace and LLMService; running-requests exists on both engines.
    series = f'{{__name__=~"{PLIMSOLL.running}|{VLLM.running}"'
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
        {
            "name": "namespace",
            "label": "Namespace",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": f"label_values({series}}}, namespace)", "refId": "namespace"},
            "refresh": 2,
            "sort": 1,
        },
        {
            "name": SERVICE_LABEL,
            "label": "LLMService",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {
                "query": f'label_values({series}, namespace="$namespace"}}, {SERVICE_LABEL})',
                "refId": SERVICE_LABEL,
            },
            "refresh": 2,
            "sort": 1,
            "multi": True,
            "includeAll": True,
            "allValue": ".+",
        },
        {
            "name": "priority",
            "label": "Priority class",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {
                "query": f'label_values({mn.PRIORITY_REQUESTS}{{namespace="$namespace"}}, priority)',
                "refId": "priority",
            },
            "refresh": 2,
            "sort": 3,
            "multi": True,
            "includeAll": True,
        },
    ]


def kv_tiers_panel() -> dict[str, Any]:
    queries = either(rate_sum(), PLIMSOLL.prefix_queries, VLLM.prefix_queries)
    return panel(
        7,  # beside SLO attainment; the per-priority panels repeat below
        "Prefix-cache hit rate per KV tier",
        "Share of prompt tokens served from the replicas' own KV caches (primary) and from each KV "
        "tier (host CPU, disk, the shared Valkey/Redis tier) instead of recomputed (spec.kvCache; "
        "status.kvCache holds the same since start). Right: bytes/s moved between the primary cache "
        "and the tiers, and shared-tier blocks rejected by their check.",
        "percentunit",
        [
            (f"({either(rate_sum(), PLIMSOLL.prefix_hits, VLLM.prefix_hits)}) / ({queries})", "primary"),
            (f"{rate_sum('medium')(mn.KV_TIER_HITS)} / scalar({queries})", "{{medium}}"),
            (rate_sum("medium")(mn.KV_OFFLOAD_LOAD_BYTES), "{{medium}} loaded B/s"),
            (rate_sum("medium")(mn.KV_OFFLOAD_STORE_BYTES), "{{medium}} stored B/s"),
            (rate_sum()(mn.KV_SHARED_REJECTED_BLOCKS), "shared blocks rejected/s"),
        ],
        overrides=[right_axis("loaded B/s|stored B/s", "Bps"), right_axis("rejected/s", "short")],
        maximum=1,
    )


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "plimsoll / LLMService",
        "description": "Replicas of one or more LLMServices: the six panels to read side by side "
        "(docs/observability.md says what each one means).",
        "tags": ["plimsoll", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables()},
        "panels": [
            gpu_panel(),
            throughput_panel(),
            latency_panel(),
            queue_panel(),
            kv_panel(),
            errors_panel(),
            slo_panel(),
            kv_tiers_panel(),
            priority_panel(),  # last: Grafana repeats it per priority class
        ],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    sys.stdout.write(f"wrote {OUTPUT}\n")
