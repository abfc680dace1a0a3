"""The engine container of a replica: image, command line, model volume, probes. Pure.

Maps the LLMService spec onto ``plimsoll serve``, the upstream ``vllm/vllm-openai``
image or SGLang's (``python3 -m sglang.launch_server``, with ``--enable-metrics`` so
the autoscaler can read ``sglang:num_running_reqs``/``sglang:num_queue_reqs``), each
with its own spelling of the same settings, so every engine gets the same model
source, probes and drain behaviour. It does not build the Deployment around
the container (``deployment.py``) and never talks to a cluster.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_model_uri
from plimsoll.operator.resources.adapters import (
    VLLM_RUNTIME_LORA_ENV,
    adapter_placement,
    adapter_roots,
    lora_flags,
)
from plimsoll.operator.resources.credentials import engine_credential_env
from plimsoll.operator.resources.kv_cache import kv_engine_env, kv_engine_flags
from plimsoll.operator.resources.model_fetch import (
    MODEL_CACHE_MOUNT,
    MODEL_CACHE_VOLUME,
    NODE_COMPILE_SUBDIR,
    cache_volume,
    hf_local_dir,
)
from plimsoll.operator.resources.pool_view import Role, pool_view
from plimsoll.operator.resources.quantity import to_bytes
from plimsoll.operator.resources.settings import ENGINE_PORT, MODEL_MOUNT, BuildSettings

# vLLM answers POST /sleep, POST /wake_up and GET /is_sleeping only with this set.
VLLM_SLEEP_ENDPOINTS_ENV = {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}
# The engine container's name in every replica pod (the scale-up timeline reads its startedAt).
ENGINE_CONTAINER = "engine"
# The plimsoll image's HOME is /home/plimsoll (Dockerfile); compiled kernels and library caches go to
# its .cache, a bounded emptyDir since the root filesystem is read-only.
HOME_CACHE_VOLUME = "home-cache"
PLIMSOLL_HOME_CACHE = "/home/plimsoll/.cache"
# plimsoll's --compilation-cache-dir (compiled graphs, Triton kernels, the CPU plan's packed weight
# panels and weights as served): an emptyDir lives as long as the pod, so a replica whose container
# is restarted (SIGKILL, OOM, liveness) maps what its first start wrote instead of packing or
# compiling again; beside a node-local model cache it lives on the node (``node_compile_cache``).
COMPILE_CACHE_VOLUME = "engine-compile-cache"
COMPILE_CACHE_MOUNT = "/var/cache/plimsoll/compile"


@dataclass
class ModelPlacement:
    """Where the engine finds the weights: a --model value plus the volumes that make it exist."""

    model_arg: str | None
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)


def model_placement(svc: LLMService) -> ModelPlacement:
    """Map ``model.uri`` onto a --model argument and pod volumes.

    pvc:// mounts the claim read-only; hf:// reads the directory the fetch init
    container (``model_fetch.py``) downloaded to the cache volume, with the hub off;
    file:// is a path in the image; embedded:// uses the copy converted into the
    plimsoll image at build time (no --model).
    """
    location = parse_model_uri(svc.spec.model.uri)
    if location.scheme == "pvc":
        return ModelPlacement(
            model_arg=f"{MODEL_MOUNT}/{location.path}" if location.path else MODEL_MOUNT,
            volumes=[
                {"name": "model", "persistentVolumeClaim": {"claimName": location.name, "readOnly": True}}
            ],
            mounts=[{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}],
        )
    if location.scheme == "hf":
        return ModelPlacement(
            model_arg=hf_local_dir(location),
            volumes=[cache_volume(svc)],
            mounts=[{"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT, "readOnly": True}],
            # The weights are local by now; a missing file must fail, not start a second download.
            env=[{"name": "HF_HUB_OFFLINE", "value": "1"}],
        )
    if location.scheme == "file":
        return ModelPlacement(model_arg=location.name)
    return ModelPlacement(model_arg=None)


def _has_flag(args: list[str], *names: str) -> bool:
    """``--flag V`` or ``--flag=V`` given by the user in ``engine.args``."""
    return any(a in names or a.split("=", 1)[0] in names for a in args)


def _flag_value(args: list[str], name: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in ``engine.args`` (None when absent)."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def on_gpu(svc: LLMService) -> bool:
    """Replicas that serve from their GPUs: GPUs requested, and no ``--device`` other than CUDA in
    ``engine.args`` (a simulated GPU node in a test cluster runs ``--device cpu``)."""
    device = _flag_value(svc.spec.engine.args, "--device")
    return svc.spec.resources.gpu.count > 0 and (device is None or device.startswith("cuda"))


def _engine_flags(svc: LLMService, kv_cache_flag: str) -> list[str]:
    """The tuning flags both engines spell the same way, except the KV budget's name."""
    engine = svc.spec.engine
    args: list[str] = []
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.kv_cache_memory is not None:
        args += [kv_cache_flag, str(to_bytes(engine.kv_cache_memory))]
    if on_gpu(svc) and not _has_flag(engine.args, "--gpu-memory-utilization"):
        args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    if engine.block_size is not None:
        args += ["--block-size", str(engine.block_size)]
    if engine.prefix_caching is not None:
        args.append("--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching")
    if engine.scheduling_policy is not None:
        # vLLM names the FCFS continuous batcher "fcfs"; the API rejects static for vLLM.
        vllm_fcfs = engine.kind == "vllm" and engine.scheduling_policy == "continuous"
        args += ["--scheduling-policy", "fcfs" if vllm_fcfs else engine.scheduling_policy]
    args += kv_engine_flags(svc)  # offload tier, shared tier, KV events (resources/kv_cache.py)
    tp = svc.spec.tensor_parallel_size()
    if tp > 1 and not _has_flag(engine.args, "--tensor-parallel-size", "-tp"):
        args += ["--tensor-parallel-size", str(tp)]
    if engine.max_new_tokens is not None:
        if engine.kind == "vllm":
            args += ["--override-generation-config", json.dumps({"max_new_tokens": engine.max_new_tokens})]
        else:
            args += ["--max-new-tokens", str(engine.max_new_tokens)]
    if svc.spec.observability.tracing.otlp_endpoint:
        args += ["--otlp-traces-endpoint", svc.spec.observability.tracing.otlp_endpoint]
    return args + lora_flags(svc) + list(engine.args)


# SGLang's spelling of the settings both other engines share (its launch_server flags).
SGLANG_LAUNCH = ["python3", "-m", "sglang.launch_server"]
SGLANG_POLICY = {"continuous": ["--schedule-policy", "fcfs"], "priority": ["--enable-priority-scheduling"]}


def _sglang_args(svc: LLMService, model_arg: str | None) -> list[str]:
    # The API refuses sglang + embedded://, kvCacheMemory, maxNewTokens, adapters and multi-node replicas.
    assert model_arg is not None, "sglang needs a model path or repository"
    engine = svc.spec.engine
    args = ["--model-path", model_arg, "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
            "--served-model-name", svc.served_name, "--enable-metrics"]  # fmt: skip
    for value, flag in (
        (engine.max_num_seqs, "--max-running-requests"),
        (engine.max_num_batched_tokens, "--chunked-prefill-size"),
        (engine.max_model_len, "--context-length"),
        (engine.block_size, "--page-size"),
    ):
        if value is not None:
            args += [flag, str(value)]
    if engine.prefix_caching is False:
        args.append("--disable-radix-cache")  # SGLang's prefix cache (RadixAttention) is on by default
    if engine.scheduling_policy is not None:
        args += SGLANG_POLICY[engine.scheduling_policy]
    tp = svc.spec.tensor_parallel_size()
    if tp > 1 and not _has_flag(engine.args, "--tp-size", "--tensor-parallel-size", "--tp"):
        args += ["--tp-size", str(tp)]
    return args + list(engine.args)


def operator_compile_cache(svc: LLMService) -> bool:
    """Whether the operator gives the engine its compile-cache volume: plimsoll replicas whose
    ``engine.args`` name no cache directory of their own (a user's PVC there wins)."""
    if svc.spec.engine.kind != "plimsoll" or _has_flag(svc.spec.engine.args, "--compilation-cache-dir"):
        return False
    return "cache_dir" not in (_flag_value(svc.spec.engine.args, "--compilation-config") or "")


def node_compile_cache(svc: LLMService) -> bool:
    """Whether the operator's compile cache lives on the node, in the node-local model cache's
    volume (``model.cache.hostPath``, an ``hf://`` model): a replica starting from zero on a node
    that served the model before then maps the weights and panels an earlier replica wrote. The
    entries are keyed by the checkpoint's files and written under temporary names, so replicas of
    one node share them safely; whoever may write the hostPath may already write the model there."""
    return (
        operator_compile_cache(svc)
        and svc.spec.model.cache.host_path is not None
        and parse_model_uri(svc.spec.model.uri).scheme == "hf"
    )


def compile_cache_mount(svc: LLMService) -> list[dict[str, Any]]:
    """The engine container's mount of its compile cache: its own emptyDir, or the node's directory."""
    if node_compile_cache(svc):
        # Writable, unlike the models beside it; the fetch init container created the subdirectory.
        return [{"name": MODEL_CACHE_VOLUME, "mountPath": COMPILE_CACHE_MOUNT, "subPath": NODE_COMPILE_SUBDIR}]
    if operator_compile_cache(svc):
        return [{"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_MOUNT}]
    return []


def _plimsoll_args(svc: LLMService, model_arg: str | None) -> list[str]:
    args = ["serve", "--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--served-model-name", svc.served_name]
    if model_arg is not None:
        args += ["--model", model_arg]
    user = svc.spec.engine.args
    # A replica's queue and a request's life are bounded by default (engine.args still wins).
    if not _has_flag(user, "--max-waiting"):
        args += ["--max-waiting", str(svc.spec.engine.max_waiting)]
    if not _has_flag(user, "--request-timeout"):
        args += ["--request-timeout", str(svc.spec.engine.request_timeout_seconds)]
    if svc.spec.lora_enabled():
        # spec.adapters are loaded through the API from the volumes the operator mounts, and only from there.
        args.append("--allow-runtime-lora-updating")
        for root in adapter_roots(svc):
            args += ["--lora-allowed-roots", root]
    if svc.spec.router.mode == "inferencePool":
        # A Gateway's endpoint picker reads vLLM's series names (model-server protocol).
        args += ["--metrics-compat", "vllm"]
    if svc.spec.engine.profiling:
        args.append("--enable-profiling")
    if svc.spec.slo.admission == "Predicted":
        args.append("--slo-admission")  # its TTFT objective arrives with PUT /slo (handlers/attainment.py)
    if svc.spec.autoscaling.standby is not None:
        args.append("--enable-sleep-mode")
    if operator_compile_cache(svc):
        args += ["--compilation-cache-dir", COMPILE_CACHE_MOUNT]
    if svc.spec.resources.gpu.count > 0 and not _has_flag(svc.spec.engine.args, "--device"):
        # Not --device auto: an image without CUDA then fails at start in one line instead of
        # serving from the CPU while it holds a GPU.
        args += ["--device", "cuda"]
    return args + _engine_flags(svc, "--kv-cache-memory")


def _vllm_args(svc: LLMService, model_arg: str | None) -> list[str]:
    # The API validator refuses vllm + embedded://, so a model argument always exists here.
    assert model_arg is not None, "vllm needs a model path or repository"
    args = ["--model", model_arg, "--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--served-model-name"]
    nodes = svc.spec.resources.nodes
    if nodes > 1 and not _has_flag(svc.spec.engine.args, "--pipeline-parallel-size", "-pp"):
        # vLLM's multi-node layout: tensor parallel inside a node, pipeline stages across nodes, on Ray.
        args = [*args[:-1], "--pipeline-parallel-size", str(nodes), "--distributed-executor-backend", "ray",
                args[-1]]  # fmt: skip
    sleep = ["--enable-sleep-mode"] if svc.spec.autoscaling.standby is not None else []
    return [*args, svc.served_name, *sleep, *_engine_flags(svc, "--kv-cache-memory-bytes")]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def probes(svc: LLMService) -> dict[str, dict[str, Any]]:
    """Startup, readiness and liveness probes.

    Startup allows 30 minutes for weights to load before liveness applies. Startup
    and readiness are checked every second: a replica the autoscaler asked for
    counts from the moment it answers, and the scale-up timeline measured the 5 s
    period as 4.5 s between warm-up done and Ready (docs/autoscaling.md). A probe
    is one small GET a second; readiness still needs 15 failures in a row (15 s,
    as before) to take a busy replica out. plimsoll has /ready (weights, KV cache
    and warm-up done, not draining); vLLM and SGLang only have /health, which answers
    once their server is up, so it serves both purposes there.
    """
    ready_path = "/ready" if svc.spec.engine.kind == "plimsoll" else "/health"
    return {
        "startupProbe": _probe("/health", period=1, failures=1800),
        "readinessProbe": _probe(ready_path, period=1, failures=15),
        "livenessProbe": _probe("/health", period=10, failures=3),
    }


def engine_image(svc: LLMService, settings: BuildSettings) -> str:
    """The image ``svc``'s replicas run: ``engine.image``, else the operator's default for the kind
    (for plimsoll, its CUDA build on GPU replicas and its CPU build otherwise)."""
    gpu = svc.spec.resources.gpu.count > 0
    default = {
        "plimsoll": settings.plimsoll_cuda_image if gpu else settings.plimsoll_image,
        "vllm": settings.vllm_image,
        "sglang": settings.sglang_image,
    }
    return svc.spec.engine.image or default[svc.spec.engine.kind]


def engine_container(
    svc: LLMService, settings: BuildSettings, role: Role = "decode"
) -> tuple[dict[str, Any], ModelPlacement]:
    """The engine container and the volumes it needs (of pool ``role`` on a split service)."""
    svc = pool_view(svc, role)
    spec = svc.spec
    placement = model_placement(svc)
    adapters = adapter_placement(svc)
    env = [*placement.env, *engine_credential_env(svc), *kv_engine_env(svc)]
    if spec.engine.kind in ("vllm", "sglang"):
        # The root filesystem is read-only and vLLM/SGLang, torch and Triton keep caches under HOME
        # (which the upstream images leave on the root filesystem): HOME on the pod's own /tmp.
        # The plimsoll image's HOME keeps its .cache on a volume of its own (replica_pod_template).
        env.append({"name": "HOME", "value": "/tmp"})
    if spec.engine.kind == "vllm" and spec.lora_enabled():
        env.append(VLLM_RUNTIME_LORA_ENV)  # without it vLLM has no /v1/load_lora_adapter
    if spec.engine.kind == "vllm" and spec.autoscaling.standby is not None:
        env.append(VLLM_SLEEP_ENDPOINTS_ENV)  # vLLM serves /sleep and /wake_up only in its dev mode
    image = engine_image(svc, settings)
    command: list[str] | None
    if spec.engine.kind == "plimsoll":
        command = ["plimsoll"]
        args = _plimsoll_args(svc, placement.model_arg)
    elif spec.engine.kind == "sglang":
        command = list(SGLANG_LAUNCH)  # the image's entrypoint is a shell; its server is a module
        args = _sglang_args(svc, placement.model_arg)
    else:
        command = None  # the upstream image's entrypoint is its OpenAI server
        args = _vllm_args(svc, placement.model_arg)

    resources: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    for key, value in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if value is not None:
            resources["requests"][key] = value
            resources["limits"][key] = value
    if spec.resources.memory is None and settings.engine_memory_limit:
        # Never unbounded: a replica that leaks takes its own pod down, not the node's other pods.
        # The request is set too, small: a limit alone would also be the request (64Gi to schedule).
        resources["limits"]["memory"] = settings.engine_memory_limit
        resources["requests"]["memory"] = settings.engine_memory_request
    if spec.resources.gpu.count > 0:
        # Extended resources must have requests == limits; limits alone imply requests.
        resources["limits"][spec.resources.gpu.resource_name] = spec.resources.gpu.count

    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        **({"command": command} if command else {}),
        "args": args,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": [*env, *(e.to_api() for e in spec.engine.env)],
        "resources": {k: v for k, v in resources.items() if v},
        **probes(svc),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            # Writable: /tmp and /dev/shm (bounded emptyDirs) and the volumes mounted for the model.
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [
            *placement.mounts,
            *adapters.mounts,
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            *([{"name": HOME_CACHE_VOLUME, "mountPath": PLIMSOLL_HOME_CACHE}] if spec.engine.kind == "plimsoll" else []),
            *compile_cache_mount(svc),
            *spec.volume_mounts,
        ],
    }
    if settings.pre_stop_sleep_seconds > 0:
        # Native sleep action: no `sleep` binary needed in either image.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": settings.pre_stop_sleep_seconds}}}
    if not container["env"]:
        del container["env"]
    return container, placement
