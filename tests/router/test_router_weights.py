"""Replicas weighed by measured capacity: least in-flight, the hash ring and the bounded load follow the weights."""

import collections
import random

from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import Policy, RouterConfig
from plimsoll.router.discovery import PodDiscovery, variant_weights
from plimsoll.router.policy import HashRing, RequestFeatures, Router, weighted_cap

URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
# Two replicas of a variant that carries 8 in flight, two of one that carries 2.
WEIGHTS = {URLS[0]: 8.0, URLS[1]: 8.0, URLS[2]: 2.0, URLS[3]: 2.0}


def weighted_set() -> ReplicaSet:
    replicas = ReplicaSet.static(URLS)
    for r in replicas.replicas.values():
        r.reachable = True
    replicas.set_weights(WEIGHTS)
    return replicas


def test_least_in_flight_fills_replicas_in_proportion_to_their_weight() -> None:
    replicas = weighted_set()
    router = Router(RouterConfig(backends=tuple(URLS), policy=Policy.LEAST_INFLIGHT), replicas)
    # All idle: the heavier replicas go first (the light ones do not take turns with them).
    assert router.choose(RequestFeatures("", 0)).replica.url in URLS[:2]
    for _ in range(40):  # requests that stay: each pick sees the ones before it
        decision = router.choose(RequestFeatures("", 0))
        decision.replica.inflight += 1
    held = {u: replicas.replicas[u].inflight for u in URLS}
    assert held == {URLS[0]: 16, URLS[1]: 16, URLS[2]: 4, URLS[3]: 4}


def test_the_hash_ring_gives_keys_in_proportion_to_weight_within_ten_percent() -> None:
    ring = HashRing(URLS, 128, WEIGHTS)
    rng = random.Random(7)
    owners = collections.Counter(ring.walk(f"prompt-{rng.random()}")[0] for _ in range(20_000))
    share = {u: owners[u] / 20_000 for u in URLS}
    for url, weight in WEIGHTS.items():
        expected = weight / sum(WEIGHTS.values())
        assert abs(share[url] - expected) <= 0.1 * expected + 0.02, (url, share[url], expected)
    # Unweighted, every replica's points are the same: weighting keeps the lighter ones' as a prefix.
    assert set(HashRing(URLS, 128)._hashes) >= set(ring._hashes)


def test_prefix_affinity_sends_each_variant_traffic_in_proportion_to_its_capacity() -> None:
    replicas = weighted_set()
    router = Router(RouterConfig(backends=tuple(URLS), policy=Policy.PREFIX_AFFINITY), replicas)
    rng = random.Random(11)
    sent: collections.Counter[str] = collections.Counter()
    live: list[str] = []
    for _ in range(4000):
        decision = router.choose(RequestFeatures(f"system prompt {rng.randrange(10_000)}", 10))
        decision.replica.inflight += 1
        live.append(decision.replica.url)
        sent[decision.replica.url] += 1
        if len(live) > 30:  # a closed loop of ~30 requests in flight
            replicas.replicas[live.pop(rng.randrange(len(live)))].inflight -= 1
    big = (sent[URLS[0]] + sent[URLS[1]]) / 4000
    assert abs(big - 0.8) <= 0.08, big  # weights 16 of 20: 80 %, within 10 %


def test_the_bounded_load_scales_with_weight_and_is_the_old_bound_when_weights_are_equal() -> None:
    assert weighted_cap(1.25, 9, 1.0, 4.0) == 4  # ceil(1.25 × 10 / 4), the unweighted bound
    assert weighted_cap(1.25, 9, 8.0, 20.0) == 5 and weighted_cap(1.25, 9, 2.0, 20.0) == 2


def test_discovery_weighs_pods_by_their_variant_from_the_llmservice_status() -> None:
    replicas = ReplicaSet()
    discovery = PodDiscovery(RouterConfig(llmservice="svc", namespace="ns"), replicas)

    def pod(name: str, ip: str, variant: str | None) -> dict[str, object]:
        labels = {"plimsoll.dev/variant": variant} if variant else {}
        return {"metadata": {"name": name, "labels": labels},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip

    discovery._replace([pod("a", "127.0.0.2", "h100"), pod("b", "127.0.0.3", "l4")])
    discovery.take_weights(
        {"variants": {"h100": {"weight": 8}, "l4": {"weight": 3}, "gone": {"weight": None}}}
    )
    assert {u: r.weight for u, r in replicas.replicas.items()} == {
        "http://127.0.0.2:8000": 8.0,
        "http://127.0.0.3:8000": 3.0,
    }
    discovery._apply("ADDED", pod("c", "127.0.0.4", "l4"))  # a new replica takes its variant's weight at once
    assert replicas.replicas["http://127.0.0.4:8000"].weight == 3.0
    assert variant_weights({}) == {}
