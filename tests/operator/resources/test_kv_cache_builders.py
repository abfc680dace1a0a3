"""spec.kvCache: the shared Valkey server's objects, the replicas' and the router's flags."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.engine import engine_container
from plimsoll.operator.resources.kv_cache import kv_children
from plimsoll.operator.resources.router import build_router_deployment
from plimsoll.operator.resources.settings import BuildSettings


def service(spec: dict[str, Any]) -> LLMService:
    return LLMService.model_validate({
        "apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"model": {"uri": "embedded://smollm2-135m"}, **spec},
    })  # fmt: skip


def test_shared_tier_deploys_valkey_and_points_replicas_at_it() -> None:
    svc = service({"kvCache": {"offload": {"size": "4Gi"}, "shared": {"size": "2Gi"}},
                   "router": {"enabled": True, "policy": "precise-prefix"}})  # fmt: skip
    deployment, service_obj = kv_children(svc)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == str(2 * 2**30) and "allkeys-lru" in args
    assert service_obj["metadata"]["name"] == deployment["metadata"]["name"] == "chat-kv"
    container, _ = engine_container(svc, BuildSettings())
    engine_args = container["args"]
    assert engine_args[engine_args.index("--kv-offloading-size") + 1] == "4"
    assert engine_args[engine_args.index("--kv-shared-url") + 1] == "redis://chat-kv.ns.svc:6379/0"
    events = json.loads(engine_args[engine_args.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    router_args = build_router_deployment(svc, BuildSettings())["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert router_args[router_args.index("--kv-tokenizer") + 1] == "smollm2-135m"
    assert router_args[router_args.index("--policy") + 1] == "precise-prefix"


def test_existing_endpoint_deploys_nothing() -> None:
    svc = service({"kvCache": {"shared": {"endpoint": "redis://cache.infra:6379/2"}}})
    assert kv_children(svc) == []
    args = engine_container(svc, BuildSettings())[0]["args"]
    assert args[args.index("--kv-shared-url") + 1] == "redis://cache.infra:6379/2"
    assert "--kv-events-config" not in args


def test_precise_prefix_needs_a_tokenizer_the_router_can_read() -> None:
    with pytest.raises(ValidationError, match="tokenizer in the router pod"):
        LLMService.model_validate({
            "apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "x"},
            "spec": {"model": {"uri": "hf://org/model"}, "router": {"policy": "precise-prefix"}},
        })  # fmt: skip


def test_the_deployed_valkey_requires_a_password_the_replicas_get_from_the_secret() -> None:
    svc = service({"kvCache": {"shared": {}}})
    deployment, _ = kv_children(svc)
    pod = deployment["spec"]["template"]["spec"]
    valkey = pod["containers"][0]
    assert valkey["env"] == [{"name": "VALKEY_PASSWORD",
                              "valueFrom": {"secretKeyRef": {"name": "chat-admin-key", "key": "kv-password"}}}]  # fmt: skip
    assert {"name": "auth", "mountPath": "/run/valkey"} in valkey["volumeMounts"]
    assert pod["volumes"] == [{"name": "auth", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]
    engine = engine_container(svc, BuildSettings())[0]
    assert {"name": "PLIMSOLL_KV_SHARED_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "chat-admin-key", "key": "kv-password"}}} in engine["env"]  # fmt: skip
    assert not any("password" in str(arg).lower() for arg in engine["args"])


def test_an_existing_endpoint_takes_its_password_from_a_named_secret() -> None:
    svc = service({"kvCache": {"shared": {"endpoint": "redis://cache.infra:6379/2",
                                          "passwordSecretRef": {"name": "cache-auth", "key": "password"}}}})  # fmt: skip
    engine = engine_container(svc, BuildSettings())[0]
    assert {"name": "PLIMSOLL_KV_SHARED_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "cache-auth", "key": "password"}}} in engine["env"]  # fmt: skip
    plain = engine_container(service({"kvCache": {"shared": {"endpoint": "redis://cache.infra:6379/2"}}}),
                             BuildSettings())[0]  # fmt: skip
    assert not any(e["name"] == "PLIMSOLL_KV_SHARED_PASSWORD" for e in plain["env"])


@pytest.mark.parametrize(
    ("shared", "message"),
    [
        ({"endpoint": "redis://:hunter2@cache.infra:6379/0"}, "holds credentials"),
        ({"passwordSecretRef": {"name": "cache-auth"}}, "is for an existing endpoint"),
    ],
)
def test_a_password_in_the_spec_or_for_no_endpoint_is_refused(shared: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        service({"kvCache": {"shared": shared}})


def test_the_rendered_start_command_runs_a_server_that_refuses_strangers(tmp_path: Any) -> None:
    """The Valkey container's own command line, run against this machine's real server binary: the
    password comes from the environment, is required, and is not on the server's command line."""
    import shutil
    import subprocess
    import time
    from pathlib import Path

    import redis

    from plimsoll.runtime.testing import free_port

    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    assert binary is not None, "install valkey-server or redis-server (.ci/run does)"
    valkey = kv_children(service({"kvCache": {"shared": {"size": "64Mi"}}}))[0]["spec"]["template"]["spec"][
        "containers"
    ][0]
    command = [c.replace("/run/valkey", str(tmp_path)) for c in valkey["command"]]
    args = list(valkey["args"])
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    command[3] = binary  # "$0": the image's valkey-server, here this machine's server
    proc = subprocess.Popen([*command, *args, "--bind", "127.0.0.1"], env={"PATH": "/usr/bin:/bin",
                            "VALKEY_PASSWORD": "pw-0c5e2"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 20.0
        while True:  # up once it answers at all; a NOAUTH answer is the point
            try:
                redis.Redis(port=port).set("k", b"v")
                raise AssertionError("the server took a write without the password")
            except redis.exceptions.AuthenticationError:
                break
            except redis.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
        assert redis.Redis(port=port, password="pw-0c5e2").set("k", b"v")
        cmdline = (Path(f"/proc/{proc.pid}/cmdline")).read_bytes()
        assert b"pw-0c5e2" not in cmdline
        assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0  # umask 077: the pod's other users cannot read it
    finally:
        proc.terminate()
        proc.wait(10)
