"""Pod status while init containers run, fail and complete (the pod runner's kubelet rules)."""

from plimsoll.devcluster import podspec
from plimsoll.devcluster.podspec import ContainerState


def _conditions(status: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


def test_pod_is_pending_and_not_initialized_until_init_containers_complete() -> None:
    main = ContainerState("engine", "img", reason="PodInitializing")
    fetch = ContainerState("fetch-model", "img", state="running", started_at="t0")
    status = podspec.pod_status([main], "Always", [], "t1", init_containers=[fetch])
    assert status["phase"] == "Pending"
    assert _conditions(status)["Initialized"] == "False" and _conditions(status)["Ready"] == "False"
    assert status["initContainerStatuses"][0]["state"] == {"running": {"startedAt": "t0"}}

    # Failed, in back-off: the last termination keeps its exit code and message.
    fetch.state, fetch.reason, fetch.restart_count = "waiting", "CrashLoopBackOff", 1
    fetch.last_exit_code, fetch.last_message = 3, "RepositoryNotFound: repository org/x not found"
    status = podspec.pod_status([main], "Always", status["conditions"], "t2", init_containers=[fetch])
    assert status["phase"] == "Pending"
    last = status["initContainerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["message"].startswith("RepositoryNotFound")

    fetch.state, fetch.exit_code, fetch.ready = "terminated", 0, True
    main.state, main.ready = "running", True
    status = podspec.pod_status([main], "Always", status["conditions"], "t3", init_containers=[fetch])
    assert status["phase"] == "Running" and _conditions(status)["Initialized"] == "True"
    assert _conditions(status)["Ready"] == "True"


def test_failed_init_container_fails_a_never_restarting_pod() -> None:
    fetch = ContainerState("fetch-model", "img", state="terminated", exit_code=6)
    status = podspec.pod_status([ContainerState("engine", "img")], "Never", [], "t", init_containers=[fetch])
    assert status["phase"] == "Failed"


def test_pods_without_init_containers_are_unchanged() -> None:
    status = podspec.pod_status(
        [ContainerState("engine", "img", state="running", ready=True)], "Always", [], "t"
    )
    assert "initContainerStatuses" not in status and _conditions(status)["Initialized"] == "True"
