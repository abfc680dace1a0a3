"""Per-LLMService prefix-cache hit rates, from the replicas' scraped counters (``status.kvCache``).

What it is: a pure function over the last scrape of each Ready replica: tokens looked up,
found in the replica's own cache, and found in each KV tier (``plimsoll_kv_tier_hits_total``
by medium), summed over the replicas since they started. What it is not: a rate over a
window (the dashboard computes those from the same counters) or anything vLLM exports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plimsoll.operator.scaling.metrics import PodSample


def kv_cache_status(samples: Mapping[str, PodSample]) -> dict[str, Any] | None:
    """``status.kvCache`` (camelCase, as stored), or None before any replica reported a lookup."""
    queries = sum(s.prefix_queries or 0.0 for s in samples.values())
    if queries <= 0:
        return None
    primary = sum(s.prefix_hits or 0.0 for s in samples.values())
    tiers: dict[str, float] = {}
    for s in samples.values():
        for medium, hits in s.tier_hits.items():
            tiers[medium] = tiers.get(medium, 0.0) + hits
    rates = {m: round(h / queries, 4) for m, h in sorted(tiers.items())}
    return {
        "queriedTokens": queries,
        "primaryHitRate": round(primary / queries, 4),
        "tierHitRates": rates,
        "hitRate": round((primary + sum(tiers.values())) / queries, 4),
    }
