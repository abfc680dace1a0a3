"""The OpenAI-compatible wire format: request and response models for the HTTP API.

What it is: pydantic models for ``/v1/completions`` and ``/v1/chat/completions``
(requests, non-streaming responses, SSE chunks), ``/v1/models`` and the error
body, plus the vLLM extensions plimsoll accepts (``ignore_eos``, ``min_tokens``,
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``skip_special_tokens``, ``allowed_token_ids``) and OpenAI's ``logit_bias``. Ranges
are checked here, so a bad value is a 400 that names the field; they come from
``sampling_params.LIMITS``, the table the engine's own check reads, so both agree.
:meth:`to_sampling_params` turns a valid request into the engine's :class:`SamplingParams`.

What it is not: the serving logic (``serving_*.py``) or the engine's own checks.
Unknown fields are ignored, as OpenAI and vLLM do; every sampling field the two
endpoints document is either served or refused with a 400, never dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from plimsoll.runtime.engine.sampling_params import (
    LIMITS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MIN_TEMPERATURE,
    SamplingParams,
)

MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_CHARS = 256  # per stop string: the detokenizer scans for every stop at every token
MIN_SLO_MS = 1e-3  # PUT /slo bounds: a microsecond; anything smaller rounds to 0 s


INTEGER_FIELDS = ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "seed", "token_id")


def bounds(name: str) -> dict[str, Any]:
    """pydantic's range arguments for ``LIMITS[name]`` (the engine checks the same range)."""
    ge, le, gt, lt = LIMITS[name]
    extra = {} if name in INTEGER_FIELDS else {"allow_inf_nan": False}
    return {"ge": ge, "le": le, "gt": gt, "lt": lt, **extra}


def limited(name: str, default: Any = None) -> Any:
    """A pydantic Field with the range ``LIMITS[name]``."""
    return Field(default, **bounds(name))


TokenId = Annotated[StrictInt, Field(**bounds("token_id"))]  # StrictInt: `true` is not token id 1
StopField = Annotated[str | list[str] | None, Field(default=None, description="Up to 16 stop strings.")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContinuationField(_Request):
    """``continuation``: carry on a stream another replica started (the router's in-flight migration).

    ``token_ids`` are the output tokens already generated and delivered; ``num_chars`` how many
    characters of their text the client has received. The rest of the request is the one first
    sent, unchanged (``max_tokens`` still counts the whole output). The answer is the rest of the
    stream: no role chunk, no ``prompt_token_ids``, usage counting the whole request.
    """

    token_ids: list[TokenId] = Field(min_length=1)
    num_chars: int = Field(0, ge=0)


class _SamplingFields(_Request):
    """Fields the two endpoints share, with OpenAI's ranges and vLLM's extensions."""

    model: str | None = None
    n: int = limited("n", 1)
    temperature: float | None = limited("temperature")
    top_p: float | None = limited("top_p")
    presence_penalty: float | None = limited("presence_penalty")
    frequency_penalty: float | None = limited("frequency_penalty")
    seed: int | None = limited("seed")
    stop: StopField
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = limited("top_k")
    min_p: float | None = limited("min_p")
    repetition_penalty: float | None = limited("repetition_penalty")
    min_tokens: int = limited("min_tokens", 0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    # OpenAI: token id (as a JSON object key, so a string) -> bias added to its logit; -100 bans it.
    logit_bias: dict[str, Annotated[float, Field(**bounds("logit_bias"))]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    skip_special_tokens: bool = True
    # vLLM: lower runs first under --scheduling-policy priority; ignored by the other policies.
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    # vLLM's prefill/decode disaggregation (--kv-transfer-config): do_remote_decode asks this replica to
    # prefill and hold the blocks; do_remote_prefill with remote_* fields to pull them before decoding.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM: token ids beside the text (``token_ids`` per choice, ``prompt_token_ids`` once).
    return_token_ids: bool | None = None
    continuation: ContinuationField | None = None
    # vLLM: salts the prefix cache, so only requests with the same salt share cached blocks.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def _check_continuation(self) -> None:
        if self.continuation is not None and not self.stream:
            raise ValueError("continuation carries on a stream; send it with stream=true")
        if self.continuation is not None and self.n != 1:
            raise ValueError(f"continuation carries on one sequence; send n=1, not n={self.n}")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return v

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def token_id_fields(self) -> dict[str, list[int]]:
        """Every token id the client sent, by field (the server checks them against the vocabulary)."""
        return {
            "stop_token_ids": list(self.stop_token_ids or []),
            "logit_bias": [int(k) for k in self.logit_bias or {}],
            "allowed_token_ids": list(self.allowed_token_ids or []),
        }

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=_temperature(self.temperature),
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            kv_transfer_params=self.kv_transfer_params,
            logit_bias={int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class _PromptTruncation(_Request):
    """vLLM's prompt truncation fields, shared by both endpoints."""

    truncate_prompt_tokens: Literal[-1] | Annotated[int, Field(ge=1, le=2**31 - 1)] | None = Field(
        None,
        description="Keep only this many prompt tokens (-1: as many as the context holds beside at "
        "least one completion token); a longer prompt is cut instead of refused.",
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="left (default) keeps the last N tokens; right keeps the first N."
    )


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    return 0.0 if value < MIN_TEMPERATURE else value  # as vLLM: a vanishing temperature is greedy


PromptField = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    | list[TokenId]
    | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
)


class CompletionRequest(_SamplingFields, _PromptTruncation):
    """``POST /v1/completions``."""

    prompt: PromptField
    max_tokens: int | None = limited("max_tokens", 16)
    logprobs: int | None = limited("logprobs")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @property
    def num_seqs(self) -> int:
        """Sequences this request puts in the engine: prompts x max(n, best_of)."""
        return len(self.prompts()) * max(self.n, self.best_of or 1)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: PromptField) -> PromptField:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and any(isinstance(p, list) and len(p) == 0 for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported; leave best_of out")
        if self.echo and self.stream:
            raise ValueError("echo with stream=true is not supported; set one of them to false")
        self._check_continuation()
        if self.continuation is not None and len(self.prompts()) != 1:
            raise ValueError("continuation carries on one prompt; send a single prompt")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt(s) as a batch: several strings or several token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [[int(x) for x in p]]  # type: ignore[arg-type]
        return list(p)  # type: ignore[return-value,unused-ignore]

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._sampling(max_tokens, self.logprobs)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields, _PromptTruncation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = limited("max_tokens")
    max_completion_tokens: int | None = limited("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = limited("logprobs")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true; set logprobs to true")
        self._check_continuation()
        return self

    @property
    def num_seqs(self) -> int:
        return self.n

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)


# ---- responses ------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object (parallel arrays)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Only with return_token_ids (``token_id_fields`` leaves them out otherwise), as vLLM.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM: what a decode replica needs (do_remote_decode)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # only with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # vLLM: what a decode replica needs (do_remote_decode)
    prompt_token_ids: list[int] | None = None  # only with return_token_ids


def response_body(response: BaseModel, return_token_ids: bool | None) -> dict[str, Any]:
    """A response as JSON, with the token-id fields only when the request asked for them."""
    if return_token_ids:
        return response.model_dump(mode="json")
    exclude: Any = {"prompt_token_ids": True, "choices": {"__all__": {"token_ids", "prompt_token_ids"}}}
    return response.model_dump(mode="json", exclude=exclude)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "plimsoll"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and not needed)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class SLOObjectives(BaseModel):
    """``PUT /slo``: the LLMService's ``spec.slo`` in its own spelling; each bound applies per request."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    ttft_p95_ms: float | None = Field(None, ge=MIN_SLO_MS, allow_inf_nan=False, alias="ttftP95Ms")
    tpot_p50_ms: float | None = Field(None, ge=MIN_SLO_MS, allow_inf_nan=False, alias="tpotP50Ms")
    e2e_p95_ms: float | None = Field(None, ge=MIN_SLO_MS, allow_inf_nan=False, alias="e2eP95Ms")

    def seconds(self) -> dict[str, float | None]:
        def s(ms: float | None) -> float | None:
            return None if ms is None else ms / 1000

        return {"ttft": s(self.ttft_p95_ms), "tpot": s(self.tpot_p50_ms), "e2e": s(self.e2e_p95_ms)}

    @classmethod
    def from_seconds(cls, bounds: dict[str, float]) -> SLOObjectives:
        def ms(key: str) -> float | None:
            return None if key not in bounds else float(f"{bounds[key] * 1000:.12g}")

        return cls(ttft_p95_ms=ms("ttft"), tpot_p50_ms=ms("tpot"), e2e_p95_ms=ms("e2e"))
