"""The replica-planning handler's own bookkeeping, without a cluster: a deleted service leaves no series behind."""

from prometheus_client import REGISTRY

from plimsoll.operator.handlers.attainment import SLO_ATTAINMENT
from plimsoll.operator.handlers.replica_planning import REQUESTS_CUT, forget_series


def test_a_services_series_go_when_its_loop_ends() -> None:
    REQUESTS_CUT.labels("team-a", "chat").inc(2)
    SLO_ATTAINMENT.labels("team-a", "chat", "1m").set(0.98)
    REQUESTS_CUT.labels("team-a", "other").inc(1)
    cut = "plimsoll_operator_requests_cut_by_scale_down_total"
    assert REGISTRY.get_sample_value(cut, {"namespace": "team-a", "llmservice": "chat"}) == 2
    forget_series("team-a", "chat")
    assert REGISTRY.get_sample_value(cut, {"namespace": "team-a", "llmservice": "chat"}) is None
    attainment = {"namespace": "team-a", "llmservice": "chat", "window": "1m"}
    assert REGISTRY.get_sample_value("plimsoll_operator_slo_attainment_ratio", attainment) is None
    assert REGISTRY.get_sample_value(cut, {"namespace": "team-a", "llmservice": "other"}) == 1
    forget_series("team-a", "chat")  # twice, or never seen: nothing to drop, no error
    forget_series("team-a", "other")
