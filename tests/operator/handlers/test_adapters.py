"""spec.adapters: rendered into the replicas without the list in the pod template, and kept in line live.

The pure half (flags, volumes, the load/unload plan, status and condition) is checked on
built objects; the live half (``handlers/adapters.sync_pod``) over real HTTP against
bench-simulator replicas, which speak vLLM's adapter API, and against a real plimsoll
engine for its refusal to unload an adapter in use.
"""

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from plimsoll.bench.simulator import ServiceCurve, serving_simulator
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.adapters import sync_pod
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.resources.adapters import (
    PodAdapters,
    adapters_condition,
    adapters_status,
    claim_volume_name,
    desired_adapters,
    loaded_adapters,
    plan_pod,
)
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0")
LOG = logging.getLogger("test")


def svc(adapters: list[dict[str, str]], model: str = "pvc://weights/llama", **engine: Any) -> LLMService:
    if engine.get("kind", "plimsoll") == "plimsoll":
        engine.setdefault("loraAllowedRoots", ["/"])  # the file:// adapters below lie anywhere
    return LLMService.from_body(
        {
            "metadata": {"name": "chat", "namespace": "ns", "generation": 3},
            "spec": {"model": {"uri": model}, "engine": engine, "adapters": adapters},
        }
    )


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def template(service: LLMService) -> dict[str, Any]:
    return dict(build_deployment(service, SETTINGS)["spec"]["template"])


def test_plimsoll_and_vllm_get_lora_flags_but_not_the_adapter_list() -> None:
    adapters = [{"name": "sql", "uri": "file:///adapters/sql"}, {"name": "fr", "uri": "pvc://weights/lora/fr"}]
    plimsoll = engine_container(build_deployment(svc(adapters, maxLoraRank=32), SETTINGS))
    args = plimsoll["args"]
    assert args[args.index("--enable-lora") :][:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32"]
    assert "--lora-modules" not in args, "the adapter list must stay out of the pod template"
    vllm = engine_container(build_deployment(svc(adapters, kind="vllm", maxLoras=8), SETTINGS))
    assert vllm["args"][vllm["args"].index("--enable-lora") + 2] == "8"
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in vllm["env"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in json.dumps(plimsoll.get("env") or [])
    off = engine_container(build_deployment(svc([]), SETTINGS))
    assert "--enable-lora" not in off["args"]
    assert "--enable-lora" in engine_container(build_deployment(svc([], enableLora=True), SETTINGS))["args"]


def test_adding_and_removing_live_adapters_leaves_the_pod_template_unchanged() -> None:
    """file:// and adapters on the model's claim need nothing in the pod: the template (and so its hash) stays."""
    one = [{"name": "sql", "uri": "file:///adapters/sql"}]
    two = [*one, {"name": "fr", "uri": "pvc://weights/lora/fr"}]
    assert template(svc(one)) == template(svc(two)) == template(svc(two[::-1]))
    # Another claim is a volume in the pod: declaring the first adapter on it rolls the pods once.
    other = template(svc([*two, {"name": "de", "uri": "pvc://tenant-b/de"}]))
    volumes = {v["name"]: v for v in other["spec"]["volumes"]}
    volume = claim_volume_name("tenant-b")
    assert volumes[volume]["persistentVolumeClaim"] == {"claimName": "tenant-b", "readOnly": True}
    mounts = {m["name"]: m for m in other["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[volume] == {"name": volume, "mountPath": "/mnt/adapters/tenant-b", "readOnly": True}
    more = template(svc([*two, {"name": "de", "uri": "pvc://tenant-b/de"}, {"name": "it", "uri": "pvc://tenant-b/it"}]))
    assert more == other


def test_adapter_paths_per_scheme_and_hf_adapters_fetched_at_start() -> None:
    service = svc(
        [
            {"name": "sql", "uri": "file:///adapters/sql"},
            {"name": "fr", "uri": "pvc://weights/lora/fr"},
            {"name": "de", "uri": "pvc://tenant-b"},
            {"name": "hf", "uri": "hf://org/lora-x@v2"},
        ]
    )
    assert desired_adapters(service) == {
        "sql": "/adapters/sql",
        "fr": "/mnt/models/lora/fr",
        "de": "/mnt/adapters/tenant-b",
        "hf": "/var/cache/plimsoll/models/hf/org/lora-x/v2",
    }
    pod = build_deployment(service, SETTINGS)["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["args"] == ["hf://org/lora-x@v2", "--local-dir", "/var/cache/plimsoll/models/hf/org/lora-x/v2"]
    assert fetch["name"].startswith("fetch-adapter-") and len(fetch["name"]) <= 63
    assert "model-cache" in {v["name"] for v in pod["volumes"]}, "the pvc model has no cache volume of its own"


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ([{"name": "a", "uri": "file:///x"}, {"name": "a", "uri": "file:///y"}], "more than once"),
        ([{"name": "chat", "uri": "file:///x"}], "base model's served name"),
        ([{"name": "a", "uri": "embedded://smollm2-135m"}], "String should match pattern"),
    ],
)
def test_bad_adapter_lists_are_refused(adapters: list[dict[str, str]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        svc(adapters)


def test_a_file_adapter_outside_the_allowed_roots_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"outside engine\.loraAllowedRoots"):
        svc([{"name": "a", "uri": "file:///srv/a"}], loraAllowedRoots=["/srv/other"])
    assert svc([{"name": "a", "uri": "file:///srv/a"}], loraAllowedRoots=["/srv"]).spec.adapters
    assert svc([{"name": "a", "uri": "file:///srv/a"}], kind="vllm").spec.adapters  # vLLM has no roots


def test_enable_lora_false_with_adapters_is_refused() -> None:
    with pytest.raises(ValidationError, match="adapters need LoRA"):
        svc([{"name": "a", "uri": "file:///x"}], enableLora=False)


def test_plan_loads_missing_unloads_undeclared_and_reloads_a_moved_adapter() -> None:
    desired = {"a": "/p/a", "b": "/p/b2", "c": "/p/c"}
    plan = plan_pod(desired, {"b": "/p/b1", "c": "", "old": "/p/old"})
    assert plan.unload == ("old", "b")
    assert plan.load == (("a", "/p/a"), ("b", "/p/b2"))
    assert plan_pod(desired, {"a": "/p/a", "b": "/p/b2", "c": "/p/c"}).load == ()
    models = {"data": [{"id": "chat", "parent": None}, {"id": "a", "parent": "chat", "root": "/p/a"}, {"id": "z"}]}
    assert loaded_adapters(models, "chat") == {"a": "/p/a"}


def test_status_and_condition_follow_the_pods() -> None:
    service = svc([{"name": "a", "uri": "file:///a"}, {"name": "b", "uri": "file:///b"}])
    good = PodAdapters(pod="chat-1", loaded=("a", "b"))
    refused = PodAdapters(pod="chat-2", loaded=("a",), failed=(("b", "HTTP 400: no adapter_config.json"),))
    rows = adapters_status(service, [good, refused])
    assert rows[0] == {"name": "a", "uri": "file:///a", "loadedOn": ["chat-1", "chat-2"]}
    assert rows[1]["failures"] == [{"pod": "chat-2", "message": "HTTP 400: no adapter_config.json"}]
    failed = adapters_condition(service, [good, refused])
    assert (failed.status, failed.reason) == ("False", "AdapterLoadFailed")
    assert "b on chat-2: HTTP 400: no adapter_config.json" in failed.message
    assert adapters_condition(service, [good]).reason == "AdaptersLoaded"
    assert adapters_condition(service, []).status == "Unknown"
    partial = adapters_condition(service, [good, PodAdapters(pod="chat-3", loaded=("a",))])
    assert (partial.status, partial.reason, partial.message) == ("False", "Loading", "not loaded yet: b on chat-3")
    assert adapters_condition(service, [PodAdapters(pod="x", error="ConnectError")]).reason == "ReplicaUnreachable"


def make_adapter(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return str(folder)


async def test_sync_pod_loads_reports_refusals_and_unloads_over_http(tmp_path: Path) -> None:
    good = make_adapter(tmp_path, "good")
    curve = ServiceCurve(model="chat", enable_lora=True, lora_modules=(f"stale={make_adapter(tmp_path, 'stale')}",))
    async with serving_simulator(curve) as url, httpx.AsyncClient() as http:
        desired = {"good": good, "broken": str(tmp_path / "missing")}
        after, loaded, unloaded = await sync_pod(ReplicaClient(http), url, "chat-1", desired, "chat", LOG)
        assert (after.loaded, loaded, unloaded) == (("good",), ["good"], ["stale"])
        ((name, message),) = after.failed
        assert name == "broken" and message.startswith("HTTP 400") and "not a directory" in message
        listed = (await http.get(f"{url}/v1/models")).json()["data"]
        assert {m["id"]: m.get("parent") for m in listed} == {"chat": None, "good": "chat"}

        # Nothing left to do on the next pass except the refused one, which is asked again.
        again, loaded, unloaded = await sync_pod(ReplicaClient(http), url, "chat-1", desired, "chat", LOG)
        assert (again.loaded, loaded, unloaded, len(again.failed)) == (("good",), [], [], 1)
        gone, _, unloaded = await sync_pod(ReplicaClient(http), url, "chat-1", {}, "chat", LOG)
        assert (gone.loaded, unloaded) == ((), ["good"])


async def test_sync_pod_names_an_unreachable_replica() -> None:
    async with httpx.AsyncClient() as http:
        result, _, _ = await sync_pod(ReplicaClient(http), "http://127.0.0.1:9", "chat-1", {"a": "/a"}, "chat", LOG)
    assert result.error is not None and result.loaded == ()


@pytest.mark.slow
async def test_sync_pod_leaves_an_adapter_in_use_on_a_real_engine_and_unloads_it_once_free(tmp_path: Path) -> None:
    """The runtime refuses to unload an adapter with a request in flight (HTTP 400, "retry later"):
    the operator keeps it listed, records no load failure, and unloads it on a pass after the request."""
    from plimsoll.runtime.testing import ThreadedServer, write_random_lora, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    fr = write_random_lora(model, tmp_path / "fr", r=4, target_modules=("q_proj",), seed=3)
    server = ThreadedServer(
        model, enable_lora=True, max_lora_rank=8, lora_modules=[{"name": "fr", "path": str(fr)}], step_delay=0.05,
        server={"allow_runtime_lora_updating": True},  # as the operator starts plimsoll replicas with LoRA on
    ).start()
    base = server.ctx.settings.served_model_name
    body = {"model": "fr", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                chunks = stream.aiter_text()
                assert await anext(chunks)  # the request is running under fr (100 steps of >= 50 ms)
                held, loaded, unloaded = await sync_pod(ReplicaClient(http), server.url, "chat-1", {}, base, LOG)
                assert (held.loaded, held.failed, held.error, loaded, unloaded) == (("fr",), (), None, [], [])
                async for _ in chunks:  # let it finish
                    pass
            after, _, unloaded = await sync_pod(ReplicaClient(http), server.url, "chat-1", {}, base, LOG)
            assert (after.loaded, unloaded) == ((), ["fr"])
            cards = (await http.get(f"{server.url}/v1/models")).json()["data"]
            assert [c["id"] for c in cards] == [base]
    finally:
        server.stop()
