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


def closed_loop(
    replicas: ReplicaSet, router: Router, latency: dict[str, float], clients: int, picks: int
) -> dict[str, float]:
    """A closed loop in event time: ``clients`` requests always in flight, each held ``latency[url]``
    on its replica (the load's own effect left out: the split is what is asked, not the speed).
    Each replica's share of the picks."""
    sent: collections.Counter[str] = collections.Counter()
    done: list[tuple[float, int, str]] = []
    now = 0.0
    for n in range(picks):
        if len(done) >= clients:  # the earliest request in flight finishes; its client sends again
            done.sort()
            now, _, url = done.pop(0)
            replicas.replicas[url].inflight -= 1
        replica = router.choose(RequestFeatures("", 0)).replica
        replica.inflight += 1
        sent[replica.url] += 1
        done.append((now + latency[replica.url], n, replica.url))
    return {u: sent[u] / picks for u in URLS}


# Requests/s at each replica's target: the fast pair 10, the slow pair 1. At their targets (8 and 2
# in flight) a fast request takes 0.8 s and a slow one 2 s; below them, on a host that slows every
# request alike, both take about as long.
RATES = {URLS[0]: 10.0, URLS[1]: 10.0, URLS[2]: 1.0, URLS[3]: 1.0}


def test_a_closed_loop_below_the_targets_sends_traffic_in_proportion_to_the_measured_rates() -> None:
    for latency in ({u: 1.0 for u in URLS}, {URLS[0]: 0.5, URLS[1]: 0.5, URLS[2]: 1.5, URLS[3]: 1.5}):
        replicas = weighted_set()
        replicas.set_weights(WEIGHTS, RATES)
        router = Router(RouterConfig(backends=tuple(URLS), policy=Policy.LEAST_INFLIGHT), replicas)
        share = closed_loop(replicas, router, latency, clients=12, picks=4400)
        for url, rate in RATES.items():
            want = rate / sum(RATES.values())
            assert abs(share[url] - want) <= 0.1 * want, (latency, url, share[url], want)
    # Evening out in-flight per weight instead (no rates known): the slow pair hold a fifth of the
    # in-flight, so with latencies alike they get a fifth of the requests, not their 9 %.
    replicas = weighted_set()
    router = Router(RouterConfig(backends=tuple(URLS), policy=Policy.LEAST_INFLIGHT), replicas)
    share = closed_loop(replicas, router, {u: 1.0 for u in URLS}, clients=12, picks=4400)
    assert share[URLS[2]] + share[URLS[3]] > 1.5 * 2 / 22


def test_a_replica_holding_its_target_and_more_than_its_share_is_passed_over() -> None:
    replicas = weighted_set()
    replicas.set_weights(WEIGHTS, RATES)
    router = Router(RouterConfig(backends=tuple(URLS), policy=Policy.LEAST_INFLIGHT), replicas)
    stuck = replicas.replicas[URLS[0]]
    stuck.inflight = 20  # slower now than measured: its requests pile up
    picks = collections.Counter(router.choose(RequestFeatures("", 0)).replica.url for _ in range(50))
    assert picks[URLS[0]] == 0 and picks[URLS[1]] > picks[URLS[2]] > 0
    assert router.choose(RequestFeatures("", 0)).reason == "capacity_share"
    # Every one over its target (an overload): those holding more than 1.25 × their weight's share
    # of the in-flight (the stuck one, and the light pair at 100 against a share of 70) wait.
    for r in replicas.replicas.values():
        r.inflight = 100
    stuck.inflight = 400
    picks = collections.Counter(router.choose(RequestFeatures("", 0)).replica.url for _ in range(20))
    assert picks == {URLS[1]: 20}
