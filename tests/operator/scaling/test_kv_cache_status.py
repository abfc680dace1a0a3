"""status.kvCache: hit rates per tier from the replicas' counters."""

from plimsoll.operator.scaling.kv_cache import kv_cache_status
from plimsoll.operator.scaling.metrics import parse_scrape

SCRAPE = """
plimsoll_num_requests_running{model_name="m"} 0
plimsoll_num_requests_waiting{model_name="m"} 0
plimsoll_prefix_cache_queries_total{model_name="m"} %d
plimsoll_prefix_cache_hits_total{model_name="m"} %d
plimsoll_kv_tier_hits_total{medium="CPU",model_name="m"} %d
plimsoll_kv_tier_hits_total{medium="SHARED",model_name="m"} %d
"""


def test_hit_rates_sum_over_replicas() -> None:
    samples = {
        "a": parse_scrape(SCRAPE % (1000, 400, 100, 0)),
        "b": parse_scrape(SCRAPE % (1000, 200, 0, 300)),
    }
    assert kv_cache_status(samples) == {
        "queriedTokens": 2000.0, "primaryHitRate": 0.3, "tierHitRates": {"CPU": 0.05, "SHARED": 0.15}, "hitRate": 0.5,
    }  # fmt: skip
    assert kv_cache_status({"a": parse_scrape(SCRAPE % (0, 0, 0, 0))}) is None
