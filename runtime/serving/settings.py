"""The HTTP server's settings: one validated object built by ``plimsoll serve`` and passed down.

What it is not: the engine's settings (``engine/config.py``), which the server never reads.
"""

from pydantic import BaseModel, ConfigDict, Field


class ServerSettings(BaseModel):
    """The server's one validated config object (the engine has its own)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="the name clients put in `model`")
    api_key: str | None = Field(None, description="require `Authorization: Bearer KEY` on /v1/*")
    admin_api_key: str | None = Field(
        None,
        description="require `Authorization: Bearer KEY` on control endpoints (/drain, PUT /slo, LoRA "
        "load/unload, /debug/*); without one they answer loopback clients only",
    )
    max_waiting: int | None = Field(None, ge=0, description="waiting requests beyond which new ones get 429")
    request_timeout: float | None = Field(None, gt=0, description="seconds before a request is aborted")
    drain_timeout: float = Field(20.0, ge=0, description="seconds SIGTERM waits for in-flight requests")
    max_tenant_inflight_tokens: int | None = Field(
        None, ge=1, description="prompt + max_tokens one tenant may have in flight before 429"
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="max_tokens for a request that sends none, and the most any request gets (larger "
        "ones are lowered to it); None: the rest of the context",
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted; larger ones get 413"
    )
    allow_client_chat_template: bool = Field(
        False, description="let clients send their own chat_template (rendering costs unbounded CPU)"
    )
    chat_template_workers: int = Field(
        2, ge=1, le=64, description="processes rendering client chat templates (with allow_client_chat_template)"
    )
    tokenize_timeout: float = Field(
        10.0, gt=0, description="seconds tokenising and template rendering may take before a 400"
    )
    enable_profiling: bool = Field(False, description="answer POST /debug/profile (torch or py-spy profiles)")
    profile_dir: str | None = Field(None, description="where profiles are also written (default: a fresh $TMPDIR/plimsoll-profiles-XXXX, mode 0700)")
    allow_runtime_lora_updating: bool = Field(
        False, description="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's opt-in)"
    )
    lora_allowed_roots: tuple[str, ...] = Field(
        (), description="directories run-time LoRA loads may read from (resolved, symlinks followed)"
    )
    max_registered_loras: int = Field(
        64, ge=1, description="adapters registered at once (start-up ones included); more loads get 400"
    )
    enable_prompt_tokens_details: bool = Field(
        False, description="report usage.prompt_tokens_details.cached_tokens (vLLM's flag; off by default)"
    )
    tenant_cache_isolation: bool = Field(
        True,
        description="fold the tenant (x-gateway-inference-fairness-id) into the prefix-cache salt, so "
        "tenants never share cached blocks",
    )
    min_client_priority: int = Field(
        0,
        description="lowest vLLM priority (lower runs first) a client may give itself in the body; higher "
        "priorities come only from an x-gateway-inference-objective the server knows",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and 503")
    wake_api_key: str | None = Field(None, description="a key POST /wake_up takes too (and nothing else does)")
    slo_admission: bool = Field(
        False,
        description="refuse (429) a request whose predicted TTFT exceeds the TTFT objective set by PUT /slo "
        "when it carries no x-slo-ttft-ms of its own (a request's header is honoured either way)",
    )
    inference_objectives: dict[str, int] = Field(
        default_factory=dict,
        description="x-gateway-inference-objective name -> vLLM priority (lower first), "
        "from --inference-objective NAME=PRIORITY",
    )
