"""The two pools of a split LLMService: each one's signal, its target, its count, and what the service runs and why.

What it is: pure pieces of the replica planner for ``spec.disaggregation``.

- **Prefill pool** (count ``spec.disaggregation.prefill.replicas``): its signal is
  the prefill backlog, ``waiting prompt tokens ÷ the profiled prefill rate``, in seconds per replica
  (``plimsoll_prefill_backlog_tokens`` over ``status.disaggregation.prefill.profile.promptTokensPerSecond``),
  against ``targetBacklogSeconds`` (default a quarter of the TTFT SLO, else 1 s): a replica whose queue
  takes longer than that to clear makes first tokens late. The HPA formula, its tolerance and
  stabilisation windows are the built-in autoscaler's (``autoscaler.py``), fed this signal per pod by
  the planner (the one place that decides counts; ``inputs.py`` builds each pool's configuration).
  A prefill replica holds a request for a moment (one token), so a scale-down lowers the count at once.
- **Decode pool** (the service's replicas): its signal is the decode load,
  ``max(running sequences ÷ target sequences, KV use ÷ targetKvUsage)`` per pod, against 1.0; the
  target sequences are ``targetSequencesPerReplica`` or ⌊headroom × the decode profile's sequences at the
  TPOT SLO⌋. :func:`decode_load` gives the planner's default-pool rule that signal instead of in-flight.
- **Why** (:func:`split_status`): ``status.disaggregation``'s reasons and prediction: with both pools
  profiled and ``linkBandwidth`` set, ``plimsoll.disaggregation.predict`` compares aggregated serving with
  the split at the ratio running now (and its neighbours), and says whether the split pays.

What it is not: I/O, the HPA formula, or any decision on a count (``planner.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from plimsoll.disaggregation import (
    NO_CLEAR_GAIN,
    Ratio,
    ServiceProfile,
    parse_bandwidth,
    predict,
    pull_stall_for,
    verdict,
)
from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation
from plimsoll.operator.scaling.sizing import NoTargetError
from plimsoll.operator.scaling.timestamps import rfc3339_seconds

PREFILL_POOL = "prefill"
DEFAULT_BACKLOG_S = 1.0


def pool_status(status: dict[str, Any], role: str) -> dict[str, Any]:
    return dict(((status.get("disaggregation") or {}).get(role)) or {})


def _profile(status: dict[str, Any], role: str) -> dict[str, Any]:
    return dict(pool_status(status, role).get("profile") or {})


def with_signal(pods: tuple[PodObservation, ...], value: Any) -> tuple[PodObservation, ...]:
    """The pods with each sample's in-flight replaced by ``value(sample)`` (the autoscaler's per-pod metric)."""
    out = []
    for p in pods:
        sample = p.sample
        if sample is not None:
            sample = dataclasses.replace(sample, running=float(value(sample)), waiting=0.0)
        out.append(dataclasses.replace(p, sample=sample))
    return tuple(out)


def pool_autoscaler_status(decided: dict[str, Any], signal: str) -> dict[str, Any]:
    """A pool's ``autoscaler`` block from the HPA decision's status (``Decision.to_status``), the signal named."""
    block = dict(decided)
    inputs = dict(block["inputs"])
    inputs["signal"] = signal
    inputs["target"] = inputs.pop("targetInFlightPerReplica")
    inputs["averagePerPod"] = inputs.pop("averageInFlightPerPod")
    for key in ("inFlight", "waiting"):
        inputs.pop(key, None)
    return {**block, "inputs": inputs}


# -- the decode pool ----------------------------------------------------------------------------


def decode_target(spec: LLMServiceSpec, status: dict[str, Any]) -> tuple[float, str]:
    """Sequences per decode replica, and where it came from; NoTargetError when nothing says."""
    d = spec.disaggregation
    assert d is not None
    if d.decode.target_sequences_per_replica is not None:
        return d.decode.target_sequences_per_replica, "disaggregation.decode.targetSequencesPerReplica"
    if spec.capacity.mode == "Manual" and spec.capacity.concurrency_per_replica is not None:
        return float(spec.capacity.concurrency_per_replica), "capacity.concurrencyPerReplica (Manual)"
    sequences = _profile(status, "decode").get("sequencesPerReplica")
    if sequences:
        return float(sequences), "the decode profile (sequences at the TPOT SLO)"
    raise NoTargetError(
        "the decode pool has no target yet: it is profiled once a decode replica is Ready (or set "
        "disaggregation.decode.targetSequencesPerReplica)"
    )


def decode_signal(spec: LLMServiceSpec, status: dict[str, Any]) -> str:
    """The decode load's formula, with its targets and where they came from."""
    sequences, source = decode_target(spec, status)
    assert spec.disaggregation is not None
    return f"decode load = max(running ÷ {sequences:g} ({source}), KV use ÷ {spec.disaggregation.decode.target_kv_usage:g})"


def decode_load_of(spec: LLMServiceSpec, status: dict[str, Any]) -> Callable[[PodSample], float]:
    """One decode pod's load: ``max(running ÷ target sequences, KV use ÷ targetKvUsage)``."""
    sequences, _ = decode_target(spec, status)
    assert spec.disaggregation is not None
    kv = spec.disaggregation.decode.target_kv_usage
    return lambda s: max(s.in_flight / sequences, (s.kv_usage or 0.0) / kv)


def decode_load(
    spec: LLMServiceSpec, status: dict[str, Any], pods: tuple[PodObservation, ...]
) -> tuple[PodObservation, ...]:
    """The decode pods with their decode load as the autoscaler's per-pod metric."""
    return with_signal(pods, decode_load_of(spec, status))


# -- the prefill pool ---------------------------------------------------------------------------


def prefill_rate(spec: LLMServiceSpec, status: dict[str, Any]) -> tuple[float, str]:
    """Prompt tokens per second one prefill replica computes; NoTargetError before the profile."""
    rate = _profile(status, "prefill").get("promptTokensPerSecond")
    if rate:
        return float(rate), "the prefill profile"
    if spec.capacity.mode == "Manual":
        raise NoTargetError(
            "capacity.mode Manual profiles no pool, so the prefill pool has no measured prefill rate and "
            "stays at disaggregation.prefill.replicas; use capacity.mode Profile to scale it"
        )
    raise NoTargetError(
        "the prefill pool has no measured prefill rate yet: it is profiled once a prefill replica is Ready"
    )


def backlog_target(spec: LLMServiceSpec) -> tuple[float, str]:
    d = spec.disaggregation
    assert d is not None
    if d.prefill.target_backlog_seconds is not None:
        return d.prefill.target_backlog_seconds, "disaggregation.prefill.targetBacklogSeconds"
    if spec.slo.ttft_p95_ms is not None:
        return spec.slo.ttft_p95_ms / 4000, "a quarter of slo.ttftP95Ms"
    return DEFAULT_BACKLOG_S, "the default (no TTFT SLO)"


def prefill_backlog(pods: tuple[PodObservation, ...], rate: float) -> tuple[PodObservation, ...]:
    """The prefill pods with their backlog in seconds (waiting prompt tokens ÷ ``rate``) as the per-pod metric."""
    return with_signal(pods, lambda s: (s.prefill_backlog_tokens or 0.0) / rate)


def prefill_signal(rate: float, source: str) -> str:
    return f"prefill backlog: waiting prompt tokens ÷ {rate:,.0f} tokens/s ({source}), seconds per replica"


def prefill_no_target(now: float, current: int, error: NoTargetError) -> dict[str, Any]:
    """The prefill pool's ``autoscaler`` block before its profile gives it a rate."""
    return {"time": rfc3339_seconds(now), "formula": "no prefill rate", "decision": {
        "currentReplicas": current, "desiredReplicas": current, "reason": "NoTarget", "message": str(error)}}  # fmt: skip


# -- why ---------------------------------------------------------------------------------------


def split_status(
    spec: LLMServiceSpec, status: dict[str, Any], prefill: int, decode: int, kv_bytes_per_token: float | None
) -> dict[str, Any]:
    """``status.disaggregation``'s reasons and prediction (pure; merged into the stored block by the caller).

    The workload predicted for is ``capacity.profile.workload`` (the request shape the service declares);
    ``kv_bytes_per_token`` is what a replica reports (``plimsoll_kv_cache_bytes_per_token``).
    """
    d = spec.disaggregation
    assert d is not None
    reasons = [f"split: spec.disaggregation asks for prefill and decode pools ({prefill}P:{decode}D now)"]
    pre, dec = _profile(status, "prefill"), _profile(status, "decode")
    missing = [what for what, ok in (
        ("the prefill profile", pre.get("promptTokensPerSecond")),
        ("the decode profile", dec.get("sequencesPerReplica") and dec.get("tpotSeconds")),
        ("a replica's KV bytes per token", kv_bytes_per_token),
        ("spec.disaggregation.linkBandwidth", d.link_bandwidth),
    ) if not ok]  # fmt: skip
    if missing:
        reasons.append("no prediction of whether it pays yet: it needs " + ", ".join(missing))
        return {"reasons": reasons, "prediction": None}
    assert d.link_bandwidth is not None and kv_bytes_per_token is not None
    # The decode pool's TPOT at its knee is a step without prefill stalls (it prefills nothing); the
    # prediction runs each layout at that many sequences per replica, where the operator loads it.
    profile = ServiceProfile(float(pre["promptTokensPerSecond"]), float(dec["sequencesPerReplica"]),
                             float(dec["tpotSeconds"]), kv_bytes_per_token)  # fmt: skip
    ratios = {Ratio(max(1, prefill), max(1, decode)), Ratio(1, 1), Ratio(1, 2), Ratio(2, 1)}
    slo, workload = spec.slo, spec.capacity.profile.workload
    layouts = predict(
        profile, float(workload.input_tokens), float(workload.output_tokens), parse_bandwidth(d.link_bandwidth),
        sorted(ratios, key=lambda r: (r.replicas, r.prefill)),
        ttft_slo_s=slo.ttft_p95_ms / 1e3 if slo.ttft_p95_ms else None,
        tpot_slo_s=slo.tpot_p50_ms / 1e3 if slo.tpot_p50_ms else None,
        pull_stall=pull_stall_for(spec.resources.gpu.count),
    )  # fmt: skip
    v = verdict(layouts)
    now = Ratio(max(1, prefill), max(1, decode)).name
    if v.choice == "split":
        reasons.append(
            f"the prediction agrees: split at {v.ratio} serves more good requests per replica (now {now})"
        )
    elif v.category == NO_CLEAR_GAIN:
        reasons.append(f"the prediction sees no clear gain from the split (inside the {v.band:.0%} band): "
                       "consider removing spec.disaggregation, the simpler layout")  # fmt: skip
    else:
        reasons.append("the prediction says aggregated serves more good requests per replica: "
                       "consider removing spec.disaggregation")  # fmt: skip
    reasons += v.reasons
    return {"reasons": reasons, "prediction": {**v.to_dict(), "linkBandwidth": d.link_bandwidth}}
