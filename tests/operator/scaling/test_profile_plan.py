"""The profiler's decision table (``scaling/profile_plan.decide``), without a cluster."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.scaling.inputs import spec_profile_hash
from plimsoll.operator.scaling.profile_plan import REPROFILE_ANNOTATION, JobView, Plan, decide


def _svc(annotations: dict[str, str] | None = None, **capacity: Any) -> LLMService:
    return LLMService.from_body(
        {
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u", "annotations": annotations or {}},
            "spec": {
                "model": {"uri": "file:///models/tiny"},
                "engine": {"maxNumSeqs": 8},
                "capacity": capacity,
            },
        }
    )


def _cond(plan: Plan, type_: str) -> tuple[str, str] | None:
    return next(((c[1], c[2]) for c in plan.conditions if c[0] == type_), None)


H, OLD = "sha256:new", "sha256:old"


def test_first_profile_waits_for_a_replica_then_starts() -> None:
    svc = _svc()
    waiting = decide(svc, H, None, [], has_ready_pod=False)
    assert waiting.start is None and _cond(waiting, "Profiled") == ("False", "WaitingForReplica")
    plan = decide(svc, H, None, [], has_ready_pod=True)
    assert plan.start is not None and _cond(plan, "Profiled") == ("False", "Profiling")
    assert _cond(plan, "ProfileStale") == ("False", "NotProfiled")


def test_running_job_is_left_alone_and_finished_job_recorded_once() -> None:
    svc = _svc()
    running = decide(svc, H, None, [JobView("j", H, "Running")], has_ready_pod=True)
    assert running.start is None and running.record is None and running.delete == ()
    assert _cond(running, "Profiled") == ("False", "Profiling")
    done = decide(svc, H, None, [JobView("j", H, "Succeeded")], has_ready_pod=True)
    assert done.record == "j" and done.start is None
    recorded = decide(svc, H, H, [JobView("j", H, "Succeeded", recorded=True)], has_ready_pod=True)
    assert recorded.start is None and recorded.record is None and _cond(recorded, "Profiled") is None


def test_failed_profile_is_not_retried_until_the_job_is_gone_or_asked() -> None:
    failed = [JobView("j", H, "Failed", recorded=True)]
    assert decide(_svc(), H, None, failed, has_ready_pod=True).start is None  # back-off: no retry storm
    assert decide(_svc(), H, None, [], has_ready_pod=True).start is not None  # Job gone (TTL): retry
    asked = decide(_svc({REPROFILE_ANNOTATION: "now"}), H, None, failed, has_ready_pod=True)
    assert asked.start is not None and asked.delete == ("j",) and asked.clear_annotation


def test_stale_profile_reprofiles_automatically_or_on_annotation() -> None:
    auto = decide(_svc(), H, OLD, [], has_ready_pod=True)
    assert _cond(auto, "ProfileStale") == ("True", "SpecChanged") and auto.start is not None
    manual = _svc(reprofile="OnAnnotation")
    held = decide(manual, H, OLD, [], has_ready_pod=True)
    assert _cond(held, "ProfileStale") == ("True", "SpecChanged") and held.start is None
    assert "annotate" in next(c[3] for c in held.conditions if c[0] == "ProfileStale")
    asked = decide(
        _svc({REPROFILE_ANNOTATION: "1"}, reprofile="OnAnnotation"), H, OLD, [], has_ready_pod=True
    )
    assert asked.start is not None and asked.clear_annotation
    current = decide(manual, H, H, [], has_ready_pod=True)
    assert _cond(current, "ProfileStale") == ("False", "ProfileCurrent") and current.start is None


def test_obsolete_running_job_is_deleted_when_the_spec_changes() -> None:
    plan = decide(_svc(), H, OLD, [JobView("old", OLD, "Running")], has_ready_pod=True)
    assert plan.delete == ("old",) and plan.start is not None


def test_manual_capacity_runs_no_job() -> None:
    svc = _svc(mode="Manual", concurrencyPerReplica=6)
    plan = decide(svc, H, None, [JobView("j", H, "Running")], has_ready_pod=True)
    assert plan.start is None and plan.delete == ("j",)
    status, reason = _cond(plan, "Profiled") or ("", "")
    assert (status, reason) == ("False", "ManualCapacity")
    assert "6 concurrent requests" in next(c[3] for c in plan.conditions if c[0] == "Profiled")


def test_spec_hash_follows_engine_args() -> None:
    a = spec_profile_hash(_svc().spec, "plimsoll:test")
    changed = _svc()
    changed.spec.engine.max_num_seqs = 4
    assert spec_profile_hash(changed.spec, "plimsoll:test") != a
