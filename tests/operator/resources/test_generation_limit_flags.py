"""engine.maxNewTokens renders as each engine spells a server-side max_tokens default and limit."""

import json

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.engine import engine_container
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(
    plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0", sglang_image="lmsysorg/sglang:test"
)


def _args(engine: dict[str, object], uri: str = "embedded://smollm2-135m") -> list[str]:
    body = {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"model": {"uri": uri}, "engine": engine},
    }
    container, _ = engine_container(LLMService.from_body(body), SETTINGS)
    return list(container["args"])


def test_plimsoll_gets_max_new_tokens() -> None:
    args = _args({"maxNewTokens": 512})
    assert args[args.index("--max-new-tokens") + 1] == "512"


def test_vllm_gets_its_override_generation_config() -> None:
    args = _args({"kind": "vllm", "maxNewTokens": 512}, uri="hf://Qwen/Qwen2.5-0.5B-Instruct")
    assert json.loads(args[args.index("--override-generation-config") + 1]) == {"max_new_tokens": 512}
    assert "--max-new-tokens" not in args


def test_unset_renders_nothing() -> None:
    args = _args({})
    assert "--max-new-tokens" not in args and "--override-generation-config" not in args


def test_sglang_refuses_what_it_has_no_flag_for() -> None:
    import pytest
    from pydantic import ValidationError

    body = {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "engine": {"kind": "sglang"}},
    }
    for engine, words in (
        ({"maxNewTokens": 64}, "engine.maxNewTokens is not available with engine.kind sglang"),
        ({"kvCacheMemory": "4Gi"}, "--mem-fraction-static"),
        ({"schedulingPolicy": "static"}, "static exists only in plimsoll"),
    ):
        spec = {**body["spec"], "engine": {"kind": "sglang", **engine}}
        with pytest.raises(ValidationError, match=words):
            LLMService.from_body({**body, "spec": spec})
    embedded = {**body["spec"], "model": {"uri": "embedded://smollm2-135m"}}
    with pytest.raises(ValidationError, match="sglang cannot serve embedded://"):
        LLMService.from_body({**body, "spec": embedded})
    container, _ = engine_container(LLMService.from_body(body), SETTINGS)
    assert (
        container["command"] == ["python3", "-m", "sglang.launch_server"]
        and "--enable-metrics" in container["args"]
    )
    priority = {
        **body["spec"],
        "engine": {"kind": "sglang", "schedulingPolicy": "priority", "prefixCaching": False},
    }
    args = engine_container(LLMService.from_body({**body, "spec": priority}), SETTINGS)[0]["args"]
    assert "--enable-priority-scheduling" in args and "--disable-radix-cache" in args
