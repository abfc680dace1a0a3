"""The profiling Job and its RBAC builders: field asserts on what a cluster would run."""

from typing import Any

import pytest

from plimsoll.bench.cli import app as bench_app
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import selector_labels
from plimsoll.operator.resources.profile_job import (
    PROFILE_ARGS_ANNOTATION,
    SPEC_HASH_ANNOTATION,
    ProfileArgsError,
    build_profile_job,
    build_profiler_rbac,
    build_report_configmap,
    profile_name,
)
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(
    plimsoll_image="registry.example/plimsoll:1.2", vllm_image="vllm/vllm-openai:v0.32.0"
)
HASH = "sha256:0123456789abcdef"


def _svc(annotations: dict[str, str] | None = None, **spec: Any) -> LLMService:
    body: dict[str, Any] = {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "annotations": annotations or {}},
        "spec": {
            "model": {"uri": "hf://org/model", "servedName": "chat-model"},
            "engine": {"kind": "vllm"},
            "slo": {"ttftP95Ms": 500, "tpotP50Ms": 40},
            "capacity": {
                "headroom": 0.7,
                "profile": {
                    "workload": {
                        "inputTokens": 64,
                        "outputTokens": 8,
                        "concurrency": [1, 2, 4],
                        "requestsPerLevel": 6,
                    }
                },
            },
            **spec,
        },
    }
    return LLMService.from_body(body)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_job_runs_one_sweep_of_the_spec_workload_against_the_pod() -> None:
    svc = _svc()
    job = build_profile_job(svc, "10.0.0.7", SETTINGS, HASH)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The plimsoll image even though the replicas run vLLM: the bench lives there.
    assert container["image"] == "registry.example/plimsoll:1.2"
    assert container["command"] == ["plimsoll"]
    args = container["args"]
    assert args[:2] == ["bench", "sweep"]
    assert _flag(args, "--url") == "http://10.0.0.7:8000"
    assert _flag(args, "--model") == "chat-model"
    assert _flag(args, "--levels") == "1,2,4"
    assert _flag(args, "--requests-per-level") == "6"
    assert _flag(args, "--input-tokens") == "64" and _flag(args, "--output-tokens") == "8"
    assert _flag(args, "--slo-ttft-p95-ms") == "500.0" and _flag(args, "--slo-tpot-p50-ms") == "40.0"
    assert "--slo-e2e-p95-ms" not in args
    assert _flag(args, "--headroom") == "0.7"
    assert _flag(args, "--verify-seconds") == "60"  # capacity.verifySeconds' default
    name = profile_name(svc, HASH)
    assert _flag(args, "--report-configmap") == f"team-a/{name}"
    assert _flag(args, "--output").startswith(container["volumeMounts"][0]["mountPath"])
    spec = job["spec"]
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] > 0 and spec["ttlSecondsAfterFinished"] > 0
    assert pod["restartPolicy"] == "Never"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert job["metadata"]["annotations"][SPEC_HASH_ANNOTATION] == HASH
    owner = job["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "LLMService",
        "chat",
        "u-1",
        True,
    )
    # Not a replica: the Deployment's selector and the autoscaler's pod list must not pick it up.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert not selector_labels(svc).items() <= labels.items()


def test_every_flag_the_job_passes_exists_on_the_sweep_command() -> None:
    import typer.main

    command = typer.main.get_command(bench_app).commands["sweep"]  # type: ignore[attr-defined]
    known = {opt for p in command.params for opt in p.opts}
    args = build_profile_job(_svc(), "10.0.0.7", SETTINGS, HASH)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert {a for a in args[2:] if a.startswith("--")} <= known


def test_rbac_lets_the_job_write_only_its_configmap() -> None:
    svc = _svc()
    name = profile_name(svc, HASH)
    sa, role, binding = build_profiler_rbac(svc, name)
    job = build_profile_job(svc, "10.0.0.7", SETTINGS, HASH)
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [name],
            "verbs": ["get", "update", "patch"],
        }
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "team-a"}
    ]
    configmap = build_report_configmap(svc, HASH)
    assert configmap["metadata"]["name"] == name and configmap["data"] == {}
    # Two pools profiling at once under the one account: the Role keeps the other Job's report writable.
    _, both, _ = build_profiler_rbac(svc, name, "chat-profile-other", name)
    assert both["rules"][0]["resourceNames"] == sorted([name, "chat-profile-other"])


def test_name_follows_the_spec_hash() -> None:
    svc = _svc()
    assert profile_name(svc, HASH) == profile_name(svc, HASH)
    assert profile_name(svc, HASH) != profile_name(svc, "sha256:ffffffffffffffff")
    assert len(profile_name(_svc(), HASH)) <= 63


def test_profile_args_annotation_is_appended_and_checked() -> None:
    loose = _svc({PROFILE_ARGS_ANNOTATION: "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8"})
    args = build_profile_job(loose, "10.0.0.7", SETTINGS, HASH)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert _flag(args, "--max-client-lag-ms") == "1000"
    with pytest.raises(ProfileArgsError, match="may not set --url"):
        build_profile_job(
            _svc({PROFILE_ARGS_ANNOTATION: "--url=http://elsewhere"}), "10.0.0.7", SETTINGS, HASH
        )
    with pytest.raises(ProfileArgsError, match="shell word list"):
        build_profile_job(_svc({PROFILE_ARGS_ANNOTATION: "--seed '1"}), "10.0.0.7", SETTINGS, HASH)


def test_verify_seconds_reaches_the_sweep_and_zero_skips_the_hold() -> None:
    svc = _svc()
    body = svc.model_dump(by_alias=True, exclude_none=True)
    body["spec"]["capacity"]["verifySeconds"] = 5
    args = build_profile_job(LLMService.from_body(body), "10.0.0.7", SETTINGS, HASH)["spec"]["template"][
        "spec"
    ]["containers"][0]["args"]
    assert _flag(args, "--verify-seconds") == "5"
    body["spec"]["capacity"]["verifySeconds"] = -1
    with pytest.raises(ValueError, match=r"verifySeconds|verify_seconds"):
        LLMService.from_body(body)


def test_default_profile_uses_bench_request_counts_and_a_duration_floor() -> None:
    body: dict[str, Any] = {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
        "spec": {"model": {"uri": "hf://org/model"}},
    }
    svc = LLMService.from_body(body)
    job = build_profile_job(svc, "10.0.0.7", SETTINGS, HASH)
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--requests-per-level" not in args  # bench's own max(100, 4 × concurrency)
    assert _flag(args, "--min-duration-per-level") == "180"
    # Three times ten levels of at least 180 s plus four holds of 60 s.
    assert job["spec"]["activeDeadlineSeconds"] == 3 * (10 * 180 + 4 * 60)
    body["spec"]["capacity"] = {"profile": {"workload": {"minSecondsPerLevel": 300}}}
    long = build_profile_job(LLMService.from_body(body), "10.0.0.7", SETTINGS, HASH)
    assert long["spec"]["activeDeadlineSeconds"] == 3 * (10 * 300 + 4 * 60)  # three times its floors
    # Both flags exist on `plimsoll bench sweep` (a rename there would break every profile).
    from typer.testing import CliRunner

    help_text = CliRunner().invoke(bench_app, ["sweep", "--help"], env={"COLUMNS": "200"}).output
    assert "--min-duration-per-level" in help_text and "--requests-per-level" in help_text


def test_a_zero_floor_passes_no_floor_and_keeps_the_hour_deadline() -> None:
    svc = _svc()  # requestsPerLevel 6, default floor
    off = _svc(capacity={"profile": {"workload": {"concurrency": [1, 2], "minSecondsPerLevel": 0}}})
    args = build_profile_job(off, "10.0.0.7", SETTINGS, HASH)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--min-duration-per-level" not in args
    assert build_profile_job(off, "10.0.0.7", SETTINGS, HASH)["spec"]["activeDeadlineSeconds"] == 3600
    assert build_profile_job(svc, "10.0.0.7", SETTINGS, HASH)["spec"]["activeDeadlineSeconds"] == 3600


def test_the_load_generator_prefers_a_node_without_a_replica() -> None:
    svc = _svc()
    pod = build_profile_job(svc, "10.0.0.7", SETTINGS, HASH)["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [
        {
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {"matchLabels": selector_labels(svc)},
                "topologyKey": "kubernetes.io/hostname",
            },
        }
    ]
