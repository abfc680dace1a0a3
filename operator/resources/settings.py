"""Operator-wide settings the builders need (images, port); one validated object, no I/O.

The handlers read them once from the environment (the Helm chart sets them) and
pass them to every ``build_*`` call, so builders stay pure and testable.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plimsoll import __version__

ENGINE_PORT = 8000
# Where a pvc:// model's claim is mounted in the engine container (adapters on that claim are read there too).
MODEL_MOUNT = "/mnt/models"


class BuildSettings(BaseModel):
    """Defaults an LLMService does not spell out."""

    model_config = ConfigDict(frozen=True)

    plimsoll_image: str = Field(
        f"ghcr.io/plimsoll/plimsoll:{__version__}",
        description="Image for engine.kind plimsoll on CPU replicas (resources.gpu.count 0), and for the "
        "operator's own Jobs and the router.",
    )
    plimsoll_cuda_image: str = Field(
        f"ghcr.io/plimsoll/plimsoll:{__version__}-cuda",
        description="Image for engine.kind plimsoll on GPU replicas: the CUDA build of the same release.",
    )
    vllm_image: str = Field("vllm/vllm-openai:v0.32.0", description="Image for engine.kind vllm.")
    sglang_image: str = Field("lmsysorg/sglang:v0.5.23", description="Image for engine.kind sglang.")
    termination_grace_period_seconds: int = Field(
        120, ge=1, description="Time a replica gets to finish in-flight streams after SIGTERM."
    )
    pre_stop_sleep_seconds: int = Field(
        10, ge=0, description="Pause before SIGTERM so the Service stops routing to the pod first."
    )
    engine_memory_limit: str | None = Field(
        "64Gi", description="Memory limit of an engine container whose spec.resources.memory is unset ('' for none)."
    )
    engine_memory_request: str = Field(
        "1Gi", description="Memory request that goes with engine_memory_limit when spec.resources.memory is unset."
    )
    tmp_size_limit: str = Field("8Gi", description="sizeLimit of the replicas' /tmp emptyDir.")
    compile_cache_size_limit: str = Field(
        "8Gi", description="sizeLimit of the plimsoll replicas' --compilation-cache-dir emptyDir (outlives restarts)."
    )
    shm_size_limit: str = Field("16Gi", description="sizeLimit of the replicas' /dev/shm (memory-backed).")
    operator_namespace: str | None = Field(
        None, description="Where the operator's pod runs (the NetworkPolicy lets it reach the replicas)."
    )
    operator_pod_labels: dict[str, str] = Field(
        default_factory=dict, description="The operator pod's labels (the NetworkPolicy's peer for it)."
    )
    metrics_scraper_peers: tuple[dict[str, Any], ...] = Field(
        ({"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},),
        description="NetworkPolicyPeers that scrape the replicas' /metrics (default: Prometheus pods anywhere).",
    )
