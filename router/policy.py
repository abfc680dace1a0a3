"""Routing policies: which replica gets the next request, and why.

What it is: pure decisions over the replica set's current loads — round-robin
(the baseline a Kubernetes Service gives), least in-flight (own in-flight count
plus each replica's scraped waiting queue), prefix affinity (consistent hashing
of the request's model and the prompt's leading characters with bounded load),
optional length lanes in front of any of them, and LoRA adapter affinity: a
request whose ``model`` is an adapter some replicas serve goes to one of those,
preferring replicas where it is already active (no adapter swap) unless that
would overload them. Replicas are weighed by their measured capacity
(``Replica.weight``, the in-flight one replica of its variant carries at its target, and
``Replica.rate``, the requests/s it finishes there): least in-flight sends each replica
requests in proportion to its rate (load per unit of weight when rates are not known), and
the hash ring and the bounded load give a replica keys and load in proportion to its weight. Each decision carries a reason that ends up in
``plimsoll_router_routing_decisions_total``. What it is not: I/O; the proxy
calls :meth:`Router.choose` and does the HTTP.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from plimsoll.router.backends import Replica, ReplicaSet
from plimsoll.router.config import LaneConfig, Policy, RouterConfig

if TYPE_CHECKING:
    from plimsoll.router.kv_events import KVEventSubscriber
    from plimsoll.router.kv_index import KVBlockIndex


class NoReadyReplica(Exception):
    """No replica is ready (or every ready one was already tried for this request)."""


class AllSaturated(Exception):
    """Every ready replica is at --max-inflight-per-replica; the client should retry later."""


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What routing reads from a request body: the prefix key, a size estimate and the model asked for."""

    prefix_key: str
    estimated_tokens: int
    model: str = ""
    # The prompt's KV block hashes (vLLM's integer form), for --policy precise-prefix only.
    block_hashes: tuple[int, ...] | None = None

    @classmethod
    def from_body(cls, body: Any, *, prefix_chars: int, chars_per_token: float = 4.0) -> RequestFeatures:
        """Read features from a parsed OpenAI request body; anything unexpected yields empty features.

        The router never rejects a body itself: a malformed request still goes to a
        replica, whose own 4xx the client then sees unchanged.
        """
        if not isinstance(body, dict):
            return cls(prefix_key="", estimated_tokens=0)
        text, prompt_tokens = _prompt_text(body, chars_per_token)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        extra = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
        model = body.get("model")
        if not isinstance(model, str):
            model = ""
        # The model is part of the key: the same prompt under two adapters has two KV prefixes.
        key = f"{model}\n{text[:prefix_chars]}" if text and model else text[:prefix_chars]
        return cls(prefix_key=key, estimated_tokens=prompt_tokens + extra, model=model)


def prompt_tokens(body: Any, chars_per_token: float = 4.0) -> int:
    """A request body's estimated prompt tokens (0 for anything unexpected)."""
    return _prompt_text(body, chars_per_token)[1] if isinstance(body, dict) else 0


def _prompt_text(body: dict[str, Any], chars_per_token: float) -> tuple[str, int]:
    """The prompt as text (chat messages rendered role by role) and its estimated token count."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for message in body["messages"]:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else ''}\n")
        text = "".join(parts)
        return text, math.ceil(len(text) / chars_per_token)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # batched prompts: route by the first
    if isinstance(prompt, str):
        return prompt, math.ceil(len(prompt) / chars_per_token)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # Pre-tokenised prompt: the token ids themselves are the prefix.
        return ",".join(str(t) for t in prompt), len(prompt)
    return "", 0


@dataclass(frozen=True, slots=True)
class Decision:
    replica: Replica
    reason: str
    lane: str = "all"


class Picker(Protocol):
    name: str

    def pick(self, candidates: Sequence[Replica], features: RequestFeatures) -> Decision: ...


class RoundRobin:
    """Each candidate in turn, blind to load: what a Kubernetes Service gives, kept for comparison."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Replica], features: RequestFeatures) -> Decision:
        replica = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(replica, "round_robin")


class LeastInflight:
    """The candidate with the least load (own in-flight + scraped waiting) per unit of its weight;
    replicas with a measured rate get traffic in proportion to it.

    Equal weights: the least load, ties in turn. Replicas of hardware variants (each with its
    variant's requests/s at its target, ``Replica.rate``) are picked by that rate instead:
    start-time fair queueing, each pick advancing the chosen replica's tag by ``1 / rate`` and the
    next going to the smallest tag, so each replica's share of the requests is its share of the
    summed rates whatever the latencies are. Evening out in-flight per weight would not do that:
    a replica's throughput is its in-flight over its latency, so a closed loop below the targets
    (or a host that slows every replica alike) gives the light, slow replicas more than their
    share. A replica is passed over while it holds its target (weight) and more than
    ``load_factor`` × its weight's share of the in-flight (slower now than it measured); when
    every candidate is, the least load per unit of weight decides.
    """

    name = "least_inflight"

    def __init__(self, load_factor: float = 1.25) -> None:
        self._tie_break = 0
        self._load_factor = load_factor
        # Fair-queueing tags by URL: where each replica's next request may start, in 1/rate units.
        # A replica back after a pause (unready, crowded) starts from the clock: no burst for the
        # picks it missed.
        self._finish: dict[str, float] = {}
        self._clock = 0.0

    def pick(self, candidates: Sequence[Replica], features: RequestFeatures) -> Decision:
        if len(candidates) > 1 and all(r.rate is not None for r in candidates):
            total = sum(r.load for r in candidates)
            weights = sum(r.weight for r in candidates)
            room = [
                r for r in candidates
                if r.load + 1 <= r.weight
                or r.load + 1 <= weighted_cap(self._load_factor, total, r.weight, weights)
            ]  # fmt: skip
            if room:
                return Decision(self._by_rate(room, len(candidates)), "capacity_share")
        return Decision(self._least_load(candidates), "least_inflight")

    def _by_rate(self, candidates: Sequence[Replica], known: int) -> Replica:
        start = {r.url: max(self._finish.get(r.url, 0.0), self._clock) for r in candidates}
        replica = min(candidates, key=lambda r: (start[r.url], -(r.rate or 0.0), r.url))
        self._clock = start[replica.url]
        self._finish[replica.url] = self._clock + 1.0 / (replica.rate or 1.0)
        if len(self._finish) > 4 * known + 16:  # replicas long gone
            self._finish = {u: t for u, t in self._finish.items() if t >= self._clock}
        return replica

    def _least_load(self, candidates: Sequence[Replica]) -> Replica:
        lowest = min(r.relative_load for r in candidates)
        tied = [r for r in candidates if r.relative_load == lowest]
        # Of replicas equally loaded for their size (all idle, say) the heaviest goes first: it
        # finishes soonest, and the light ones still get their share once it holds its part.
        heaviest = max(r.weight for r in tied)
        tied = [r for r in tied if r.weight == heaviest]
        replica = tied[self._tie_break % len(tied)]
        self._tie_break += 1
        return replica


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def weighted_cap(load_factor: float, total: float, weight: float, weights: float) -> int:
    """Bounded load for one replica: ``ceil(load_factor × (total load + 1) × its share of the weight)``.

    With equal weights the share is 1/candidates, the bound of consistent hashing with
    bounded loads; a replica with twice the weight may hold twice the load.
    """
    return math.ceil(load_factor * (total + 1) * weight / weights)


class HashRing:
    """A consistent-hash ring with `virtual_nodes` points per replica URL (fewer for a lighter weight).

    With ``weights`` a replica gets ``max(1, round(virtual_nodes × weight / heaviest))`` points, so
    its share of the keys follows its capacity; its points are a prefix of the unweighted ones, so
    a weight change moves only the keys of the points it adds or drops.
    """

    def __init__(
        self, urls: Iterable[str], virtual_nodes: int, weights: dict[str, float] | None = None
    ) -> None:
        urls = list(urls)
        heaviest = max((weights or {}).get(u, 1.0) for u in urls) if urls else 1.0

        def points_of(url: str) -> int:
            if not weights:
                return virtual_nodes
            return max(1, round(virtual_nodes * weights.get(url, 1.0) / heaviest))

        points = sorted((_hash64(f"{url}#{i}"), url) for url in urls for i in range(points_of(url)))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def walk(self, key: str) -> list[str]:
        """Distinct replica URLs in ring order starting at the key's position."""
        if not self._urls:
            return []
        start = bisect.bisect_right(self._hashes, _hash64(key))
        seen: dict[str, None] = {}
        n = len(self._urls)
        for i in range(n):
            seen.setdefault(self._urls[(start + i) % n], None)
        return list(seen)


class PrefixAffinity:
    """Consistent hashing on the prompt's leading characters, with bounded load.

    Requests sharing a system prompt hash to the same replica, where its KV
    prefix is cached. So that a popular prefix cannot make a hot replica, a
    replica is passed over when taking the request would lift its load above
    ``ceil(load_factor × (total load + 1) / candidates)``; the request then goes
    to the next replica on the ring (consistent hashing with bounded loads,
    Mirrokni et al. 2018). Requests without a prompt fall back to least in-flight.
    """

    name = "prefix_affinity"

    def __init__(self, replica_set: ReplicaSet, virtual_nodes: int, load_factor: float) -> None:
        self._replica_set = replica_set
        self._virtual_nodes = virtual_nodes
        self._load_factor = load_factor
        self._fallback = LeastInflight(load_factor)
        self._ring = self._build()
        # The ring covers every known replica, ready or not, so a replica going
        # unready only moves its own keys to the next node.
        replica_set.on_change.append(self._rebuild)

    def _build(self) -> HashRing:
        replicas = self._replica_set.replicas
        weights = {u: r.weight for u, r in replicas.items()}
        uneven = any(w != 1.0 for w in weights.values())
        return HashRing(replicas, self._virtual_nodes, weights if uneven else None)

    def _rebuild(self) -> None:
        self._ring = self._build()

    def pick(self, candidates: Sequence[Replica], features: RequestFeatures) -> Decision:
        if not features.prefix_key:
            decision = self._fallback.pick(candidates, features)
            return Decision(decision.replica, "prefix_no_key")
        by_url = {r.url: r for r in candidates}
        total = sum(r.load for r in candidates)
        weights = sum(r.weight for r in candidates)
        first = True
        for url in self._ring.walk(features.prefix_key):
            replica = by_url.get(url)
            if replica is None:
                continue  # not a candidate now (unready, saturated, other lane, tried)
            if replica.load + 1 <= weighted_cap(self._load_factor, total, replica.weight, weights):
                return Decision(replica, "prefix_affinity" if first else "prefix_overflow")
            first = False
        # Only reachable if the ring lacks a candidate (added since the last rebuild).
        decision = self._fallback.pick(candidates, features)
        return Decision(decision.replica, "prefix_overflow")


class PrecisePrefix:
    """The replica holding the longest tier-weighted run of the prompt's KV blocks, within bounded load.

    Scores come from the replicas' KV events (``kv_index.py``): each candidate's longest run of
    the prompt's blocks held in its primary cache, host or disk tier, or the shared tier, each
    block weighted by its tier. Among candidates under the bounded-load cap of prefix affinity
    (``ceil(load_factor × (total load + 1) / candidates)``) the best score wins, ties to the
    least loaded. Prefix affinity decides instead when the prompt could not be hashed, when no
    candidate holds any of it (a cold prefix still lands where its next turn will look), and
    when any candidate's events are stale (``kv_events.py`` logs it; the reason says it).
    """

    name = "precise_prefix"

    def __init__(self, replica_set: ReplicaSet, index: KVBlockIndex, events: KVEventSubscriber,
                 virtual_nodes: int, load_factor: float) -> None:  # fmt: skip
        self.index = index
        self.events = events
        self._load_factor = load_factor
        self._fallback = PrefixAffinity(replica_set, virtual_nodes, load_factor)

    def pick(self, candidates: Sequence[Replica], features: RequestFeatures) -> Decision:
        decision = self._pick(candidates, features)
        self.events.note_routed(decision.replica.url)
        return decision

    def _fallback_pick(self, candidates: Sequence[Replica], features: RequestFeatures, reason: str) -> Decision:
        return Decision(self._fallback.pick(candidates, features).replica, reason)

    def _pick(self, candidates: Sequence[Replica], features: RequestFeatures) -> Decision:
        if not features.block_hashes:
            return self._fallback_pick(candidates, features, "precise_unhashed")
        if not all(self.events.is_fresh(r.url) for r in candidates):
            return self._fallback_pick(candidates, features, "precise_fallback_stale")
        scores = self.index.score([r.url for r in candidates], features.block_hashes)
        total = sum(r.load for r in candidates)
        weights = sum(r.weight for r in candidates)
        eligible = [
            r for r in candidates if r.load + 1 <= weighted_cap(self._load_factor, total, r.weight, weights)
        ] or list(candidates)

        def value(r: Replica) -> float:
            s = scores.get(r.url)
            return s.weighted if s is not None else 0.0

        best = max(eligible, key=lambda r: (value(r), -r.relative_load))
        if value(best) <= 0.0:
            return self._fallback_pick(candidates, features, "precise_cold")
        overall = max(candidates, key=value)
        return Decision(best, "precise_hit" if value(best) >= value(overall) else "precise_overflow")


class Router:
    """Lanes, saturation and the chosen picker, applied in that order to the replica set."""

    def __init__(
        self, config: RouterConfig, replica_set: ReplicaSet,
        kv: tuple[KVBlockIndex, KVEventSubscriber] | None = None,
    ) -> None:  # fmt: skip
        self.replica_set = replica_set
        self.max_inflight = config.max_inflight_per_replica
        self.lanes: LaneConfig | None = config.lanes
        self.policy = config.policy
        self._load_factor = config.load_factor
        self.picker: Picker
        if config.policy is Policy.ROUND_ROBIN:
            self.picker = RoundRobin()
        elif config.policy is Policy.LEAST_INFLIGHT:
            self.picker = LeastInflight(config.load_factor)
        elif config.policy is Policy.PRECISE_PREFIX:
            assert kv is not None, "precise prefix routing needs the KV index and its event subscriber"
            self.picker = PrecisePrefix(replica_set, kv[0], kv[1], config.virtual_nodes, config.load_factor)
        else:
            self.picker = PrefixAffinity(replica_set, config.virtual_nodes, config.load_factor)

    def choose(self, features: RequestFeatures, exclude: frozenset[str] = frozenset()) -> Decision:
        """Pick a replica, or raise NoReadyReplica / AllSaturated."""
        ready = [r for r in self.replica_set.ready() if r.url not in exclude]
        if not ready:
            raise NoReadyReplica()
        available = [r for r in ready if r.load < self.max_inflight]
        if not available:
            raise AllSaturated()
        candidates, lane = self._lane(available, features)
        candidates, adapter_reason = self._adapter(candidates, features.model)
        decision = self.picker.pick(candidates, features)
        return Decision(decision.replica, adapter_reason or decision.reason, lane)

    def _adapter(self, candidates: list[Replica], model: str) -> tuple[list[Replica], str | None]:
        """The candidates serving adapter ``model``; those with it active first, within bounded load.

        No replica serving it (the base model, an unknown name, or nothing scraped yet):
        every candidate, and the picker's own reason. Active replicas are preferred while
        the lightest of them carries no more than ``load_factor`` × the serving replicas'
        mean load (+1), so an adapter's popularity spreads it rather than piling on one pod.
        """
        if not model:
            return candidates, None
        serving = [r for r in candidates if r.adapters is not None and model in r.adapters]
        if not serving:
            return candidates, None
        active = [r for r in serving if model in r.active_adapters]
        if active:
            cap = self._load_factor * (sum(r.load for r in serving) + 1) / len(serving)
            if min(r.load for r in active) + 1 <= math.ceil(cap):
                return active, "adapter_active"
        return serving, "adapter_loaded"

    def _lane(self, available: list[Replica], features: RequestFeatures) -> tuple[list[Replica], str]:
        if self.lanes is None:
            return available, "all"
        ordered = [r.url for r in self.replica_set.ordered()]
        # Lane membership follows the stable order of all replicas, not of the ready
        # ones, so a replica does not switch lanes when another goes unready.
        long_urls = set(ordered[-self.lanes.long_lane_replicas :])
        is_long = features.estimated_tokens >= self.lanes.long_request_tokens
        lane = "long" if is_long else "short"
        members = [r for r in available if (r.url in long_urls) == is_long]
        if members:
            return members, lane
        return available, f"{lane}_borrowed"
