"""Reading a capacity profile (the bench JSON report) and knowing when it is stale.

What it is: pydantic models of just the fields the operator relies on from the
report `plimsoll bench sweep` writes — ``schema_version``,
``knees.throughput.concurrency``, ``knees.latency.concurrency`` (null when no
knee was found) and ``recommendation.concurrency_per_replica`` — and
:func:`read_profile`, which turns a report into a :class:`CapacityProfile` or a
:class:`ProfileFailure` with a CamelCase reason and a readable message. Also the
hash of what a profile measured (model, image, engine, GPU), which marks
``ProfileStale`` when it changes, and :func:`profile_conditions`: the conditions
a recorded profile gives — ``Profiled`` reason ``ProfileDisturbed`` with a
warning when the bench marked levels measured on a busy host, the verification
hold's outcome in the message.

What it is not: the bench's own report writer (``plimsoll.bench.report``), which
this module deliberately does not import, so the operator image does not pull
the bench's plotting and numeric stack. A failed or unreadable report never
yields a capacity: there is no default to fall back on.
"""

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plimsoll.capacity import latency_crossing, recommend
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.scaling.drift import CurvePoint
from plimsoll.operator.scaling.formula import fmt

# Major versions of the report this reader understands.
SUPPORTED_SCHEMA_MAJOR = 1


class _Lenient(BaseModel):
    # The report has many more fields (levels, plots, workload); they are not ours to check.
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Knee(_Lenient):
    concurrency: float | None = Field(default=None, gt=0)


class _Knees(_Lenient):
    throughput: _Knee
    latency: _Knee | None = None


class _Recommendation(_Lenient):
    concurrency_per_replica: int | None = Field(default=None, ge=1)
    headroom: float | None = Field(default=None, gt=0, le=1)
    reason: str | None = None


class _Distribution(_Lenient):
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None


class _LevelLatency(_Lenient):
    ttft: _Distribution | None = None
    tpot: _Distribution | None = None
    e2e: _Distribution | None = None


class _Disturbed(_Lenient):
    reasons: list[str] = Field(default_factory=list)


class _Throughput(_Lenient):
    output_tokens_per_s: float | None = None


class _Requests(_Lenient):
    measured: int | None = None


class _Level(_Lenient):
    concurrency: int | None = None  # None for open-loop (rate) levels
    valid: bool = True
    duration_s: float | None = None
    requests: _Requests = Field(default_factory=_Requests)
    latency_ms: _LevelLatency = Field(default_factory=_LevelLatency)
    disturbed: _Disturbed | None = None
    throughput: _Throughput = Field(default_factory=_Throughput)


class _Attempt(_Lenient):
    concurrency: int
    passed: bool
    attainment: float | None = None
    why: str = ""
    windows: list[dict[str, Any]] = Field(default_factory=list)


class _Verification(_Lenient):
    verified_concurrency: int | None = Field(default=None, ge=1)
    swept_concurrency: int | None = None
    seconds: float
    attainment: float | None = None
    windows_measured: int = 0
    inconclusive: str | None = None  # why the hold proved nothing (a busy host), when it did not
    tried: list[_Attempt] = Field(default_factory=list)


class _Report(_Lenient):
    schema_version: int | str
    knees: _Knees
    recommendation: _Recommendation
    workload: dict[str, Any] | None = None
    levels: list[_Level] = Field(default_factory=list)
    verification: _Verification | None = None


@dataclass(frozen=True, slots=True)
class LevelPoint(CurvePoint):
    """One valid closed-loop level of the sweep, with its mean end-to-end latency: what planning
    against another SLO needs (the curve point alone is what the drift check compares)."""

    concurrency: int
    e2e_mean_ms: float | None = None


@dataclass(frozen=True, slots=True)
class CapacityProfile:
    """A usable measured capacity."""

    schema_version: str
    throughput_knee: float | None
    latency_knee: float | None
    concurrency_per_replica: int
    workload: dict[str, Any] | None
    headroom: float | None = None
    levels: tuple[LevelPoint, ...] = ()
    # "c=N: why" for each level the bench marked disturbed (the host was busy while it ran).
    disturbed: tuple[str, ...] = ()
    # The hold at the recommendation (status.capacity.verification), when the Job ran one.
    verification: dict[str, Any] | None = None
    # (concurrency, measured requests, measured seconds, valid) of every closed-loop level swept.
    measured_levels: tuple[tuple[int, int | None, float | None, bool], ...] = ()

    def measured(self) -> dict[str, Any]:
        """For ``status.capacity.measured``: what the sweep measured, level by level and in total."""
        workload = self.workload or {}
        levels = [
            {"concurrency": c, "requests": n, "seconds": None if t is None else round(t, 1), "valid": ok}
            for c, n, t, ok in self.measured_levels
        ]
        return {
            "levels": levels,
            "requests": sum(n or 0 for _, n, _, _ in self.measured_levels),
            "seconds": round(sum(t or 0.0 for _, _, t, _ in self.measured_levels), 1),
            "requestsPerLevel": workload.get("requests_per_level") or "max(100, 4 × concurrency)",
            "minSecondsPerLevel": workload.get("min_duration_per_level_s"),
        }

    def verification_status(self) -> dict[str, Any] | None:
        """For ``status.capacity.verification``: verified concurrency, attainment, windows, what was tried."""
        v = self.verification
        if v is None:
            return None
        return {
            "verifiedConcurrency": v["verified_concurrency"],
            "sweptConcurrency": v.get("swept_concurrency"),
            "holdSeconds": v["seconds"],
            "attainment": v.get("attainment"),
            "windowsMeasured": v.get("windows_measured", 0),
            "inconclusive": v.get("inconclusive"),
            "tried": [
                {
                    "concurrency": t["concurrency"],
                    "passed": t["passed"],
                    "attainment": t.get("attainment"),
                    "windows": len(t.get("windows") or []),
                    "why": t.get("why", "")[:300],
                }
                for t in v.get("tried") or []
            ],
        }

    def concurrency_for(
        self,
        *,
        ttft_p95_ms: float | None = None,
        tpot_p50_ms: float | None = None,
        headroom: float | None = None,
    ) -> tuple[int, str]:
        """Per-replica concurrency re-derived for another SLO or headroom, with its arithmetic.

        Without either, the report's own recommendation. Otherwise the bench's own
        rules (:mod:`plimsoll.capacity`) on the report's levels: the latency knee
        where this SLO's margin crosses zero (the report's latency knee when only
        the headroom changes), then ``⌊headroom × min(latency knee, throughput knee)⌋``.
        Raises ValueError when not even the lowest level meets the SLO, or when
        there is no knee to stand on.
        """
        if ttft_p95_ms is None and tpot_p50_ms is None and headroom is None:
            return self.concurrency_per_replica, (
                f"bench report recommendation (throughput knee {fmt_opt(self.throughput_knee)}, "
                f"latency knee {fmt_opt(self.latency_knee)})"
            )
        h = headroom if headroom is not None else (self.headroom or 0.75)
        latency_knee = self.latency_knee
        if ttft_p95_ms is not None or tpot_p50_ms is not None:
            limits = {
                name: limit
                for name, limit in (("ttft_p95", ttft_p95_ms), ("tpot_p50", tpot_p50_ms))
                if limit is not None
            }
            crossing = latency_crossing(
                [
                    (lv.concurrency, {"ttft_p95": lv.ttft_p95_ms, "tpot_p50": lv.tpot_p50_ms})
                    for lv in self.levels
                ],
                limits,
            )
            if crossing.status == "no_data":
                raise ValueError("the report has no valid closed-loop levels to check an SLO against")
            if crossing.status == "below_range":
                lowest = self.levels[0]
                broken = [
                    f"{name} {fmt_opt(value)} ms > {fmt(limits[key])} ms"
                    for key, name, value in (("ttft_p95", "TTFT p95", lowest.ttft_p95_ms),
                                             ("tpot_p50", "TPOT p50", lowest.tpot_p50_ms))
                    if key in limits and (value is None or value > limits[key])
                ]  # fmt: skip
                raise ValueError(
                    f"no measured level meets the SLO: at concurrency {lowest.concurrency}, "
                    f"{'; '.join(broken)}; one replica cannot hold this SLO at any tested load"
                )
            latency_knee = crossing.concurrency
        rec = recommend({"throughput": self.throughput_knee, "latency": latency_knee}, h)
        if rec.concurrency_per_replica is None:
            raise ValueError(f"the report has no knee to derive a per-replica concurrency from: {rec.reason}")
        return rec.concurrency_per_replica, rec.reason

    def mean_latency_s(self, concurrency: float) -> float | None:
        """Mean end-to-end seconds at ``concurrency``, interpolated between measured levels (None without data)."""
        points = [(lv.concurrency, lv.e2e_mean_ms) for lv in self.levels if lv.e2e_mean_ms is not None]
        if not points:
            return None
        if concurrency <= points[0][0]:
            return points[0][1] / 1000
        for (c0, e0), (c1, e1) in itertools.pairwise(points):
            if c0 <= concurrency <= c1:
                return (e0 + (e1 - e0) * (concurrency - c0) / (c1 - c0)) / 1000
        return points[-1][1] / 1000

    def requests_per_second(self) -> float | None:
        """Requests one replica finishes per second at its recommended concurrency (Little's law:
        concurrency ÷ the mean end-to-end latency there); None without latencies."""
        latency = self.mean_latency_s(self.concurrency_per_replica)
        return None if not latency else round(self.concurrency_per_replica / latency, 6)

    def curve(self) -> list[dict[str, Any]]:
        """For ``status.capacity.curve``: what one replica did at each level (the drift check's reference)."""
        return [
            CurvePoint(lv.concurrency, lv.output_tokens_per_s, lv.ttft_p95_ms, lv.tpot_p50_ms).to_status()
            for lv in self.levels
        ]

    def knees(self) -> dict[str, Any]:
        """For ``status.capacity.knees``."""
        return {
            "throughput": {"concurrency": self.throughput_knee},
            "latency": {"concurrency": self.latency_knee},
        }


@dataclass(frozen=True, slots=True)
class ProfileFailure:
    """Why a report gives no capacity; goes to the Profiled condition and an Event."""

    reason: str  # CamelCase
    message: str


def read_profile(report: str | bytes | Mapping[str, Any]) -> CapacityProfile | ProfileFailure:
    """Validate a bench report and extract the capacity, or say exactly why not."""
    if isinstance(report, str | bytes):
        try:
            data = json.loads(report)
        except json.JSONDecodeError as err:
            return ProfileFailure(
                "InvalidReport", f"the benchmark report is not JSON ({err}); see the Job's logs"
            )
    else:
        data = dict(report)
    if not isinstance(data, dict):
        return ProfileFailure(
            "InvalidReport", f"the benchmark report is a JSON {type(data).__name__}, not an object"
        )
    try:
        parsed = _Report.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in err.errors()
        )
        return ProfileFailure(
            "InvalidReport", f"the benchmark report lacks what the operator needs: {problems}"
        )
    version = str(parsed.schema_version)
    major = version.split(".", 1)[0]
    if major != str(SUPPORTED_SCHEMA_MAJOR):
        return ProfileFailure(
            "UnsupportedReportVersion",
            f"report schema_version {version} is not supported (this operator reads {SUPPORTED_SCHEMA_MAJOR}.x); "
            "run the benchmark with the same plimsoll version as the operator",
        )
    per_replica = parsed.recommendation.concurrency_per_replica
    if per_replica is None:
        why = parsed.recommendation.reason or "the sweep found no knee and made no recommendation"
        return ProfileFailure(
            "NoRecommendation",
            f"no per-replica concurrency from the benchmark: {why}; widen the swept concurrency levels "
            "or set capacity.mode: Manual",
        )
    return CapacityProfile(
        schema_version=version,
        throughput_knee=parsed.knees.throughput.concurrency,
        latency_knee=parsed.knees.latency.concurrency if parsed.knees.latency else None,
        concurrency_per_replica=per_replica,
        workload=parsed.workload,
        headroom=parsed.recommendation.headroom,
        disturbed=tuple(
            f"c={lv.concurrency}: {'; '.join(lv.disturbed.reasons)}"
            for lv in parsed.levels
            if lv.disturbed is not None and lv.disturbed.reasons
        )
        + (
            (f"the hold after the sweep: {parsed.verification.inconclusive}",)
            if parsed.verification is not None and parsed.verification.inconclusive
            else ()
        ),
        verification=parsed.verification.model_dump() if parsed.verification is not None else None,
        measured_levels=tuple(
            (lv.concurrency, lv.requests.measured, lv.duration_s, lv.valid)
            for lv in sorted(parsed.levels, key=lambda lv: lv.concurrency or 0)
            if lv.concurrency is not None
        ),
        levels=tuple(
            LevelPoint(
                concurrency=lv.concurrency,
                ttft_p95_ms=lv.latency_ms.ttft.p95 if lv.latency_ms.ttft else None,
                tpot_p50_ms=lv.latency_ms.tpot.p50 if lv.latency_ms.tpot else None,
                e2e_mean_ms=lv.latency_ms.e2e.mean if lv.latency_ms.e2e else None,
                output_tokens_per_s=lv.throughput.output_tokens_per_s,
            )
            for lv in sorted(parsed.levels, key=lambda lv: lv.concurrency or 0)
            if lv.valid and lv.concurrency is not None
        ),
    )


def read_profile_file(report: Path) -> CapacityProfile:
    """A bench report on disk (``plimsoll plan``): its capacity, or a ValueError naming the file and why not."""
    try:
        text = report.read_text()
    except OSError as err:
        raise ValueError(f"cannot read the bench report {report}: {err}") from None
    profile = read_profile(text)
    if isinstance(profile, ProfileFailure):
        raise ValueError(f"{report}: {profile.message}")
    return profile


def profile_conditions(
    profile: CapacityProfile, job: str, spec_hash: str
) -> tuple[tuple[ConditionUpdate, ...], str | None]:
    """The Profiled/ProfileStale conditions for a recorded profile, and a warning when it needs one.

    A profile measured while the host was busy is used (it is the best figure
    there is) but never silently: ``Profiled`` carries reason ``ProfileDisturbed``
    naming the disturbed levels, and the warning becomes a Warning Event. A
    recommendation the hold had to step down is said in the message.
    """
    message = (
        f"{profile.concurrency_per_replica} concurrent requests per replica (throughput knee "
        f"{fmt_opt(profile.throughput_knee)}, latency knee {fmt_opt(profile.latency_knee)}), Job {job}"
    )
    v = profile.verification
    if v is not None and v["verified_concurrency"] is None and v.get("inconclusive"):
        message += f"; not verified: the {fmt(v['seconds'])} s hold was inconclusive"
    elif v is not None:
        message += (
            f"; held {fmt(v['seconds'])} s at {v['verified_concurrency']}"
            + (
                f" after stepping down from {v.get('swept_concurrency')}"
                if v.get("swept_concurrency") != v["verified_concurrency"]
                else ""
            )
            + (f", SLO attainment {v['attainment']:.1%}" if v.get("attainment") is not None else "")
        )
    reason, warning = "ProfileMeasured", None
    if profile.disturbed:
        reason = "ProfileDisturbed"
        warning = (
            f"the profile was measured while the host was busy, so its knees may sit low: "
            f"{' | '.join(profile.disturbed)}; re-profile on a quieter node (annotate plimsoll.dev/reprofile) "
            "to confirm"
        )
        message = f"{message}; disturbed levels: {' | '.join(profile.disturbed)}"
    return (
        ("Profiled", "True", reason, message),
        ("ProfileStale", "False", "ProfileCurrent", f"measured on the current spec {spec_hash}"),
    ), warning


def profile_spec_hash(
    *,
    model: str,
    image: str,
    engine_kind: str,
    engine_args: Sequence[str] | Mapping[str, Any],
    gpu: Mapping[str, Any],
) -> str:
    """A short stable hash of what a profile measured; any change in these makes the profile stale.

    Canonical JSON (sorted keys) so the hash does not depend on dict order.
    Argument order in ``engine_args`` lists matters, as it does to the engine.
    """
    payload = {
        "model": model,
        "image": image,
        "engine": engine_kind,
        "engineArgs": list(engine_args) if not isinstance(engine_args, Mapping) else dict(engine_args),
        "gpu": dict(gpu),
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def is_stale(measured_hash: str | None, current_hash: str) -> bool:
    """True when a profile exists and was measured on something else than the current spec."""
    return measured_hash is not None and measured_hash != current_hash


def fmt_opt(x: float | None) -> str:
    return "none" if x is None else fmt(x)
