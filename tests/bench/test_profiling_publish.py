"""`plimsoll bench sweep --report-configmap`: the reference is checked before any load is sent, and
a report too big for a ConfigMap is refused with the reason. Writing into a real ConfigMap is
covered by the profiling test on the local control plane (test_profiling_k8s.py)."""

import pytest
from typer.testing import CliRunner

from plimsoll.bench.cli import app as bench_app
from plimsoll.bench.publish import MAX_REPORT_BYTES, PublishError, parse_configmap_ref, report_payload


def test_configmap_reference_parses_namespace_and_name() -> None:
    ref = parse_configmap_ref("team-a/chat-profile-0123abcd")
    assert (ref.namespace, ref.name) == ("team-a", "chat-profile-0123abcd")
    for bad in ("no-slash", "Team/x", "ns/", "/name", "ns/Bad_Name"):
        with pytest.raises(PublishError, match="NAMESPACE/NAME"):
            parse_configmap_ref(bad)


def test_report_payload_is_compact_json_and_refuses_oversize() -> None:
    assert report_payload({"schema_version": 1, "knees": {}}) == '{"schema_version":1,"knees":{}}'
    with pytest.raises(PublishError, match="more than a ConfigMap holds"):
        report_payload({"blob": "x" * MAX_REPORT_BYTES})


def test_sweep_refuses_a_bad_reference_before_sending_load() -> None:
    # Port 9 (discard) on loopback: if the sweep started, it would fail with a connection error instead.
    result = CliRunner().invoke(
        bench_app, ["sweep", "--url", "http://127.0.0.1:9", "--report-configmap", "not-a-ref"]
    )
    assert result.exit_code == 2
    assert "NAMESPACE/NAME" in result.output
