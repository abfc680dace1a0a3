"""Reading a Pod object: its Ready condition and its named ports."""

from plimsoll.pods import named_port, pod_is_ready


def test_named_port_finds_the_port_by_name_in_any_container_else_the_default() -> None:
    pod = {
        "spec": {
            "containers": [
                {"name": "sidecar", "ports": [{"name": "metrics", "containerPort": 9090}]},
                {
                    "name": "engine",
                    "ports": [{"containerPort": 7000}, {"name": "http", "containerPort": 8080}],
                },
            ]
        }
    }
    assert named_port(pod, "http", 8000) == 8080
    assert named_port(pod, "metrics", 8000) == 9090
    assert named_port(pod, "grpc", 8000) == 8000
    assert named_port({}, "http", 8000) == 8000
    assert named_port({"spec": {"containers": [{"name": "e", "ports": None}]}}, "http", 1) == 1


def test_pod_is_ready_reads_the_ready_condition() -> None:
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_is_ready(ready)
    assert not pod_is_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert not pod_is_ready({})
