"""spec.slo presets: objectives applied when the spec sets none, and status.slo saying so."""

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.spec import SLOSpec
from plimsoll.operator.resources.profile_job import sweep_args
from plimsoll.operator.resources.readiness import slo_status


def _svc(slo: dict[str, object] | None) -> LLMService:
    spec: dict[str, object] = {"model": {"uri": "embedded://smollm2-135m"}}
    if slo is not None:
        spec["slo"] = slo
    return LLMService.from_body({"metadata": {"name": "m"}, "spec": spec})


def test_no_objective_gets_the_interactive_preset_and_status_says_so() -> None:
    svc = _svc(None)
    assert svc.spec.slo.ttft_p95_ms == 3000 and svc.spec.slo.defaulted_from == "interactive"
    status = slo_status(svc)
    assert status["ttftP95Ms"] == 3000 and status["source"] == "preset:interactive"
    assert "spec.slo sets no objective" in status["message"] and "slo.preset: none" in status["message"]
    # The profile finds the saturation point, not how far the preset's 3 s would stretch a replica.
    assert "--slo-ttft-p95-ms" not in sweep_args(svc, "127.0.0.1", "cm")


def test_any_objective_of_the_users_replaces_the_preset() -> None:
    svc = _svc({"tpotP50Ms": 40})
    assert svc.spec.slo.ttft_p95_ms is None and svc.spec.slo.defaulted_from is None
    assert slo_status(svc) == {"tpotP50Ms": 40, "source": "spec", "message": "spec.slo: tpotP50Ms 40"}
    args = sweep_args(svc, "127.0.0.1", "cm")
    assert args[args.index("--slo-tpot-p50-ms") + 1] == "40.0" and "--slo-ttft-p95-ms" not in args


def test_preset_none_means_no_objective() -> None:
    svc = _svc({"preset": "none"})
    assert slo_status(svc)["source"] == "none" and "--slo-ttft-p95-ms" not in sweep_args(
        svc, "127.0.0.1", "cm"
    )


def test_round_trip_keeps_the_values() -> None:
    again = SLOSpec.model_validate(SLOSpec.model_validate({}).to_api())
    assert again.ttft_p95_ms == 3000
