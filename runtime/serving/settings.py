"""The HTTP server's settings: one validated object built by ``plimsoll serve`` and passed down.

What it is not: the engine's settings (``engine/config.py``), which the server never reads.
"""

from pydantic import BaseModel, ConfigDict, Field


class ServerSettings(BaseModel):
    """The server's one validated config object (the engine has its own)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="the name clients put in `model`")
    model_root: str | None = Field(None, description="where the weights came from, shown by /v1/models")
    api_key: str | None = Field(None, description="require `Authorization: Bearer KEY` on /v1/*")
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
    profile_dir: str | None = Field(None, description="where profiles are also written (default: $TMPDIR/plimsoll-profiles)")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 and 503")
    inference_objectives: dict[str, int] = Field(
        default_factory=dict,
        description="x-gateway-inference-objective name -> vLLM priority (lower first), "
        "from --inference-objective NAME=PRIORITY",
    )
