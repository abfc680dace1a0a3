"""A split LLMService whose replicas really run: each pool Ready, each profiled, each scaling on its own signal.

Every replica (both pools) is `plimsoll serve` on a tiny random model, started by the devcluster pod
runner as a local process bound to its pod IP; each pool's profile is a real `plimsoll bench sweep` Job
against one of its replicas (quick settings: a few requests per level, no floor on a level's time, no
hold); the operator, with the chart's RBAC, scrapes the engines' own /metrics. The load is real
closed-loop completions against the pods' loopback IPs (``plimsoll.devcluster.podload``):

1. long prompts for one token at the prefill pool: its backlog (waiting prompt tokens ÷ the profiled
   prefill rate) exceeds its target, so the prefill pool scales up while the decode pool, idle, stays;
2. that load stops and short prompts with long outputs go to the decode pool: its decode load (running
   sequences ÷ the profiled sequences per replica) drives the service's replicas up, while the prefill
   pool, idle now, comes back down.

Each step is checked on the planner's explained decision in ``status.disaggregation.<pool>.autoscaler``
and its Events. The engine holds two sequences, so every profile saturates inside its levels and a queue
really forms under load, whatever the CPU's speed; the targets are far below what the load produces.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.devcluster.podload import LoadConfig, PodLoad
from plimsoll.operator.resources.profile_job import PROFILE_ARGS_ANNOTATION

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "pdscale"
LONG_PROMPT = "All work and no play makes Jack a dull boy. " * 8  # ~350 tokens (byte-level tokenizer)
STARTUP_LIMIT_S = 240  # both pools' first replicas and the router, started on a shared CPU
PROFILE_LIMIT_S = 300  # both pools' sweeps, one after the other


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny random model for pods the pod runner starts (see ``pod_model``)."""
    from plimsoll.runtime.testing import pod_model

    return pod_model()


def _svc(cluster: Any, ns: str) -> dict[str, Any]:
    obj: dict[str, Any] = get_json(cluster, "llms", NAME, "-n", ns) or {}
    return obj


def _pool(obj: dict[str, Any], role: str) -> dict[str, Any]:
    return dict((((obj.get("status") or {}).get("disaggregation") or {}).get(role)) or {})


def _prefill_replicas(obj: dict[str, Any]) -> int | None:
    return ((obj.get("spec") or {}).get("disaggregation") or {}).get("prefill", {}).get("replicas")


def _desired(obj: dict[str, Any], role: str) -> int | None:
    """The count the pool's latest explained decision wants."""
    return ((_pool(obj, role).get("autoscaler") or {}).get("decision") or {}).get("desiredReplicas")


def _events(cluster: Any, ns: str, reason: str) -> list[str]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")
    return [e.get("message", "") for e in (items or {}).get("items", []) if e.get("reason") == reason]


def _until(predicate: Callable[[], Any], timeout: float, what: str, *loads: PodLoad) -> Any:
    """``wait_for`` that also surfaces a failure of the load threads."""

    def checked() -> Any:
        for load in loads:
            load.check()
        return predicate()

    return wait_for(checked, timeout, what, interval=1)


def test_each_pool_is_profiled_and_scales_on_its_own_signal(
    devcluster: Any, llms_namespace: str, tiny_model: Path
) -> None:
    ns = llms_namespace
    # Levels up to 4x what the engine holds: the throughput knee is inside them even on a noisy host.
    quick = {"concurrency": [1, 2, 4, 8], "requestsPerLevel": 8}
    manifest = llmservice(
        NAME,
        model={"uri": f"file://{tiny_model}"},
        engine={"maxNumSeqs": 2, "kvCacheMemory": "32Mi"},
        podAnnotations={},  # run the replicas for real
        replicas=1,
        scaling={"min": 1, "max": 2},
        router={"replicas": 1},
        # No objectives: each knee is where the two-sequence engine starts to queue, by the server's own
        # histograms (counted, whatever the host's speed). Against generous objectives the knee is the
        # throughput plateau, which eight requests a level on a fast host can miss.
        slo={"preset": "none"},
        capacity={
            "mode": "Profile",
            "headroom": 0.5,
            "verifySeconds": 0,
            "profile": {"workload": {"minSecondsPerLevel": 0}},
        },
        autoscaling={
            "mode": "builtin",
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": 2,
            "scaleDownStabilizationSeconds": 5,
        },
        disaggregation={
            "prefill": {
                "replicas": 1,
                "min": 1,
                "max": 2,
                # Any real queue of ~350-token prompts is many times this, whatever the measured rate.
                "targetBacklogSeconds": 0.001,
                # 16 output tokens: each request holds the engine long enough for the sweep's levels to queue.
                "profile": {"inputTokens": 128, "outputTokens": 16, **quick},
            },
            "decode": {"profile": {"inputTokens": 8, "outputTokens": 16, **quick}},
        },
    )
    manifest["metadata"]["annotations"] = {
        PROFILE_ARGS_ANNOTATION: "--max-client-lag-ms 1000 --min-concurrency-ratio 0.5 --warmup-requests 1"
    }
    apply(devcluster, ns, manifest)

    # Both pools Ready, then both profiled (each by its own Job, for its own figure).
    def ready() -> dict[str, Any] | None:
        obj = _svc(devcluster, ns)
        both = all(_pool(obj, role).get("readyReplicas") == 1 for role in ("prefill", "decode"))
        return obj if both and (condition(obj, "Ready") or {}).get("status") == "True" else None

    _until(ready, STARTUP_LIMIT_S, "both pools Ready and the service Ready=True")

    def profiled() -> dict[str, Any] | None:
        obj = _svc(devcluster, ns)
        c = condition(obj, "Profiled") or {}
        if c.get("status") == "False" and c.get("reason") not in ("Profiling", "WaitingForReplica"):
            pytest.fail(f"profiling failed: {c.get('reason')}: {c.get('message')}")
        return obj if c.get("status") == "True" else None

    obj = _until(profiled, PROFILE_LIMIT_S, "Profiled=True for both pools")
    assert condition(obj, "Profiled")["reason"] == "PoolsProfiled"
    prefill_profile, decode_profile = _pool(obj, "prefill")["profile"], _pool(obj, "decode")["profile"]
    rate, sequences = prefill_profile["promptTokensPerSecond"], decode_profile["sequencesPerReplica"]
    assert rate > 0 and prefill_profile["inputTokens"] == 128 and prefill_profile["outputTokens"] == 16
    assert sequences >= 1 and decode_profile["tpotSeconds"] > 0 and decode_profile["outputTokens"] == 16
    jobs = get_json(devcluster, "jobs", "-n", ns, "-l", "app.kubernetes.io/component=profile")["items"]
    roles = sorted(j["metadata"]["labels"].get("plimsoll.dev/role") for j in jobs)
    assert roles == ["decode", "prefill"] and all(j["status"].get("succeeded") == 1 for j in jobs)
    print(f"\nprofiles: prefill {rate:,.0f} prompt tokens/s, decode {sequences} sequences per replica")

    prefill_pods = f"app.kubernetes.io/instance={NAME},plimsoll.dev/role=prefill"
    kubeconfig = Path(devcluster.kubeconfig)
    prefill_load = PodLoad(kubeconfig, ns, NAME, LoadConfig(model=NAME, prompt=LONG_PROMPT, max_tokens=1),
                           selector=prefill_pods)  # fmt: skip
    decode_load = PodLoad(kubeconfig, ns, NAME, LoadConfig(model=NAME, prompt="Hi", max_tokens=96))
    with prefill_load, decode_load:
        # 1. Long prompts at the prefill pool: a backlog of prompt tokens, nothing to decode.
        prefill_load.set_clients(8)

        def prefill_scaled() -> dict[str, Any] | None:
            obj = _svc(devcluster, ns)
            # The count (spec) and its explanation (status) are two writes: wait for both.
            return obj if _prefill_replicas(obj) == 2 and _desired(obj, "prefill") == 2 else None

        obj = _until(prefill_scaled, 180, "the prefill pool scaled to 2 on its backlog", prefill_load)
        block = _pool(obj, "prefill")["autoscaler"]
        signal = f"waiting prompt tokens ÷ {rate:,.0f} tokens/s (the prefill profile)"
        assert signal in block["inputs"]["signal"]
        assert block["inputs"]["target"] == 0.001 and block["inputs"]["averagePerPod"] > 0.001
        # The latest tick's decision: 2 (the scale-up), or still 2 and limited by max under the same load.
        assert block["decision"]["desiredReplicas"] == 2
        assert block["decision"]["reason"] in ("ScaledUp", "TooManyReplicas"), block["decision"]
        assert obj["spec"]["replicas"] == 1, "the decode pool, idle, must not follow the prefill backlog"
        assert not _events(devcluster, ns, "ScaledUp"), "the decode pool scaled on the prefill load"
        up = _events(devcluster, ns, "PrefillScaledUp")
        assert any(m.startswith("prefill pool 1 → 2: ceil(1 × ") and " / 0.001) = " in m for m in up), up
        print(f"prefill step: {up}")

        # 2. The prefill load stops; short prompts with long outputs at the decode pool.
        prefill_load.set_clients(0)
        decode_load.set_clients(6)

        def decode_scaled() -> dict[str, Any] | None:
            obj = _svc(devcluster, ns)
            return obj if obj["spec"].get("replicas") == 2 and _desired(obj, "decode") == 2 else None

        obj = _until(decode_scaled, 180, "the decode pool scaled to 2 on its decode load", decode_load)
        block = _pool(obj, "decode")["autoscaler"]
        assert block["inputs"]["signal"] == "decode load"
        assert f"running ÷ {sequences:g} (the decode profile" in block["inputs"]["targetSource"]
        assert block["decision"]["desiredReplicas"] == 2 and block["inputs"]["averagePerPod"] > 1
        assert block["decision"]["reason"] in ("ScaledUp", "TooManyReplicas"), block["decision"]
        up = _events(devcluster, ns, "ScaledUp")
        assert any(m.startswith("1 → 2") for m in up), up
        print(f"decode step: {up}")

        # The prefill pool, idle now, comes back down on its own signal while the decode pool holds.
        def prefill_down() -> dict[str, Any] | None:
            obj = _svc(devcluster, ns)
            return obj if _prefill_replicas(obj) == 1 and _desired(obj, "prefill") == 1 else None

        obj = _until(prefill_down, 120, "the idle prefill pool back to 1", decode_load)
        assert obj["spec"]["replicas"] == 2
        down = _events(devcluster, ns, "PrefillScaledDown")
        assert any(m.startswith("prefill pool 2 → 1") for m in down), down
        # Each load answered: a 96-token decode behind five others can outlast the steps above on a
        # fast host, so wait for the first to finish rather than stop the clients mid-stream.
        for load in (prefill_load, decode_load):
            _until(lambda load=load: load.completions or None, 180, "a request of each load answered", load)
    for what, load in (("prefill", prefill_load), ("decode", decode_load)):
        failed = [c.error for c in load.completions if c.error is not None]
        ok = len(load.completions) - len(failed)
        e2e = sorted(c.e2e_s for c in load.completions if c.error is None)
        median = f", median {e2e[len(e2e) // 2]:.1f} s end to end" if e2e else ""
        print(f"{what} load: {ok} requests ok{median}, {len(failed)} failed {failed[:3]}")
        assert ok > 0, f"the {what} load got no answer: {failed[:3]}"
