"""Operator-wide settings the builders need (images, port); one validated object, no I/O.

The handlers read them once from the environment (the Helm chart sets them) and
pass them to every ``build_*`` call, so builders stay pure and testable.
"""

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
    termination_grace_period_seconds: int = Field(
        120, ge=1, description="Time a replica gets to finish in-flight streams after SIGTERM."
    )
    pre_stop_sleep_seconds: int = Field(
        10, ge=0, description="Pause before SIGTERM so the Service stops routing to the pod first."
    )
