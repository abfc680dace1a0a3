"""Pure tests of routing policies, request features, config validation, scrape parsing and pod endpoints."""

from __future__ import annotations

import collections

import pytest
from pydantic import ValidationError

from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import LaneConfig, Policy, RouterConfig
from plimsoll.router.discovery import pod_endpoint
from plimsoll.router.policy import (
    AllSaturated,
    HashRing,
    NoReadyReplica,
    PrefixAffinity,
    RequestFeatures,
    Router,
)
from plimsoll.router.scrape import parse_queue

URLS = [f"http://127.0.0.{i}:8000" for i in range(1, 5)]


def ready_set(urls: list[str]) -> ReplicaSet:
    replica_set = ReplicaSet.static(urls)
    for replica in replica_set.replicas.values():
        replica.reachable = True
    return replica_set


def make_router(policy: Policy, urls: list[str] = URLS, **kw: object) -> Router:
    return Router(RouterConfig(backends=tuple(urls), policy=policy, **kw), ready_set(urls))  # type: ignore[arg-type]


def features(text: str, tokens: int = 0) -> RequestFeatures:
    return RequestFeatures(prefix_key=text, estimated_tokens=tokens)


def test_round_robin_cycles_over_ready_replicas() -> None:
    router = make_router(Policy.ROUND_ROBIN)
    picks = [router.choose(features("x")).replica.url for _ in range(8)]
    assert picks == URLS + URLS


def test_least_inflight_counts_scraped_waiting_queue() -> None:
    router = make_router(Policy.LEAST_INFLIGHT)
    replicas = router.replica_set.ordered()
    for r, inflight in zip(replicas, [3, 1, 2, 1], strict=True):
        r.inflight = inflight
    replicas[1].waiting = 5.0  # own in-flight 1 but a long queue from elsewhere
    assert router.choose(features("")).replica is replicas[3]


def test_load_is_this_routers_exact_count_plus_what_other_routers_had_there_at_the_scrape() -> None:
    router = make_router(Policy.LEAST_INFLIGHT)
    replica = router.replica_set.ordered()[0]
    replica.inflight = 2
    assert replica.load == 2  # not scraped yet: only what this router sent
    # Scraped with this router's 2 in flight: 7 running and waiting, so 5 are other routers'.
    replica.running, replica.waiting, replica.inflight_at_scrape = 3.0, 4.0, 2
    assert replica.load == 7
    replica.inflight = 9  # a burst since the last scrape
    assert replica.load == 14
    # This router's requests finished since the scrape: the scrape's stale count of them is not load.
    replica.inflight = 0
    assert replica.load == 5
    replica.running, replica.waiting, replica.inflight_at_scrape = 1.0, 0.0, 2  # fewer than were sent
    assert replica.load == 0


def test_least_inflight_spreads_ties() -> None:
    router = make_router(Policy.LEAST_INFLIGHT)
    picks = collections.Counter(router.choose(features("")).replica.url for _ in range(40))
    assert set(picks.values()) == {10}


def test_hash_ring_moves_only_the_removed_replicas_keys() -> None:
    keys = [f"system prompt {i}" for i in range(500)]
    before = HashRing(URLS, 128)
    after = HashRing(URLS[:-1], 128)
    owner_before = {k: before.walk(k)[0] for k in keys}
    owner_after = {k: after.walk(k)[0] for k in keys}
    moved = [k for k in keys if owner_before[k] != owner_after[k]]
    assert moved and all(owner_before[k] == URLS[-1] for k in moved)
    # virtual nodes keep the split roughly even: every replica owns 15-35% of 4
    shares = collections.Counter(owner_before.values())
    assert all(0.15 < shares[u] / len(keys) < 0.35 for u in URLS)


def test_prefix_affinity_is_sticky_then_bounded() -> None:
    router = make_router(Policy.PREFIX_AFFINITY, load_factor=1.25)
    first = router.choose(features("You are a helpful assistant. " * 10))
    assert first.reason == "prefix_affinity"
    home = first.replica
    again = router.choose(features("You are a helpful assistant. " * 10))
    assert again.replica is home
    # Pile load on the home replica: beyond 1.25 x average the next ring node takes it.
    home.inflight = 6
    spill = router.choose(features("You are a helpful assistant. " * 10))
    assert spill.replica is not home and spill.reason == "prefix_overflow"
    # The spill goes to the key's next ring node, not to a random one.
    ring_order = HashRing(URLS, 128).walk("You are a helpful assistant. " * 10)
    assert spill.replica.url == ring_order[1]


def test_prefix_affinity_without_prompt_uses_least_inflight() -> None:
    router = make_router(Policy.PREFIX_AFFINITY)
    replicas = router.replica_set.ordered()
    for r in replicas[:-1]:
        r.inflight = 2
    decision = router.choose(features(""))
    assert decision.replica is replicas[-1] and decision.reason == "prefix_no_key"


def test_prefix_ring_follows_replica_set_changes() -> None:
    replica_set = ready_set(URLS[:2])
    policy = PrefixAffinity(replica_set, 64, 1.25)
    replica_set.replace(URLS)
    for r in replica_set.replicas.values():
        r.reachable = True
    owners = {policy.pick(replica_set.ready(), features(f"k{i}")).replica.url for i in range(200)}
    assert owners == set(URLS)


def test_lanes_keep_long_requests_apart_and_borrow_when_empty() -> None:
    router = make_router(Policy.LEAST_INFLIGHT, lanes=LaneConfig(long_request_tokens=1000, long_lane_replicas=1))
    long_lane = router.replica_set.ordered()[-1]
    for _ in range(6):
        decision = router.choose(features("x", tokens=4000))
        assert decision.replica is long_lane and decision.lane == "long"
        assert router.choose(features("x", tokens=10)).replica is not long_lane
    long_lane.reachable = False
    borrowed = router.choose(features("x", tokens=4000))
    assert borrowed.lane == "long_borrowed" and borrowed.replica is not long_lane


def test_saturation_and_no_ready_replica() -> None:
    router = make_router(Policy.LEAST_INFLIGHT, max_inflight_per_replica=2)
    for r in router.replica_set.ordered():
        r.inflight = 1
        r.running, r.waiting = 1.0, 1.0  # the replica's own count: this router's request and one more
    with pytest.raises(AllSaturated):
        router.choose(features(""))
    with pytest.raises(NoReadyReplica):
        router.choose(features(""), exclude=frozenset(URLS))


def test_request_features_from_bodies() -> None:
    chat = RequestFeatures.from_body(
        {"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"}],
         "max_tokens": 50}, prefix_chars=100)
    assert chat.prefix_key == "system:" + "S" * 93
    assert chat.estimated_tokens == -(-(len("system:") + 300 + 1 + len("user:hi") + 1) // 4) + 50
    parts = RequestFeatures.from_body(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}, prefix_chars=100)
    assert parts.prefix_key == "user:abc\n"
    tokens = RequestFeatures.from_body({"prompt": [1, 2, 3], "max_tokens": 5}, prefix_chars=100)
    assert tokens == RequestFeatures("1,2,3", 8)
    batch = RequestFeatures.from_body({"prompt": ["first", "second"]}, prefix_chars=3)
    assert batch.prefix_key == "fir"
    for garbage in (None, [], "text", {"prompt": 7}, {"messages": "no"}):
        assert RequestFeatures.from_body(garbage, prefix_chars=10) == RequestFeatures("", 0)


def test_config_errors_say_how_to_fix() -> None:
    with pytest.raises(ValidationError, match="either --backend"):
        RouterConfig()
    with pytest.raises(ValidationError, match="either --backend"):
        RouterConfig(backends=("http://127.0.0.1:1",), llmservice="x")
    with pytest.raises(ValidationError, match=r"--backend http://HOST:PORT"):
        RouterConfig(backends=("127.0.0.1:8000",))
    with pytest.raises(ValidationError, match="twice"):
        RouterConfig(backends=("http://127.0.0.1:1", "http://127.0.0.1:1/"))
    with pytest.raises(ValidationError, match="'plimsoll' or 'vllm'"):
        RouterConfig(backends=("http://127.0.0.1:1",), metrics_engine="sglang")


PLIMSOLL_TEXT = """# TYPE plimsoll_num_requests_waiting gauge
plimsoll_num_requests_waiting{model_name="m"} 3.0
# TYPE plimsoll_num_requests_running gauge
plimsoll_num_requests_running{model_name="m"} 5.0
"""
VLLM_TEXT = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smol"} 2.0
vllm:num_requests_waiting{engine="1",model_name="smol"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 4.0
"""


def test_parse_queue_reads_either_engine_family() -> None:
    assert parse_queue(PLIMSOLL_TEXT) == (3.0, 5.0, "plimsoll")
    assert parse_queue(VLLM_TEXT) == (3.0, 4.0, "vllm")
    assert parse_queue("# nothing here\n") == (None, None, None)
    assert parse_queue(VLLM_TEXT, "plimsoll") == (None, None, "plimsoll")


def test_pod_endpoint() -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": 9000},
                                           {"name": "http", "containerPort": 8001}]}]},
        "status": {"podIP": "127.0.10.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert pod_endpoint(pod, 8000) == ("http://127.0.10.3:8001", True)
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]  # type: ignore[index]
    assert pod_endpoint(pod, 8000) == ("http://127.0.10.3:8001", False)
    assert pod_endpoint({"metadata": {"name": "p"}, "status": {}}, 8000) is None
    terminating = {"metadata": {"name": "p", "deletionTimestamp": "now"}, "status": {"podIP": "127.0.0.9"}}
    assert pod_endpoint(terminating, 8000) is None
    assert pod_endpoint({"metadata": {"name": "p"}, "status": {"podIP": "127.0.0.9"}}, 8000) == (
        "http://127.0.0.9:8000", False)
