"""Per-request sampling and stopping parameters (the vLLM-shaped ``SamplingParams``) and their limits.

What it is: plain data, ``validate()``, and ``LIMITS``, the one table of allowed ranges
that both ``validate()`` and the HTTP request models (``serving/protocol.py``) read, so
a value the server accepts is one the engine accepts and the other way round.
What it is not: the sampling itself (see ``sampler.py``), stop detection (see
``detokenizer.py`` and ``engine.py``), or scheduling attributes: ``priority`` and the
tenant belong to the request (``Request``, ``LLMEngine.add_request``), as in vLLM.
"""

from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAX_LOGPROBS = 20  # vLLM's default max_logprobs and OpenAI's top_logprobs limit
MAX_N = 16  # sequences per request; each one is a row in the batch
MAX_STOP = 16  # stop strings, and stop token ids
MAX_LOGIT_BIAS = 300  # entries in logit_bias (OpenAI's limit)
MAX_ALLOWED_TOKEN_IDS = 2**16  # entries in allowed_token_ids
INT32_MAX = 2**31 - 1
# vLLM's _SAMPLING_EPS: below it a temperature only overflows the logits, so it means greedy.
MIN_TEMPERATURE = 1e-5


class Limit(NamedTuple):
    """A closed or half-open numeric range; ``None`` bounds are open-ended."""

    ge: float | None = None  # value >= ge
    le: float | None = None  # value <= le
    gt: float | None = None  # value > gt
    lt: float | None = None  # value < lt

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.le is None or value <= self.le)
            and (self.gt is None or value > self.gt)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        lo = f"[{self.ge:g}" if self.ge is not None else (f"({self.gt:g}" if self.gt is not None else "(-inf")
        hi = f"{self.le:g}]" if self.le is not None else (f"{self.lt:g})" if self.lt is not None else "inf)")
        return f"in {lo}, {hi}"


# The allowed range of every numeric sampling parameter: OpenAI's where it defines one
# (temperature, top_p, penalties, n, logprobs, logit_bias values), vLLM's otherwise.
LIMITS: dict[str, Limit] = {
    "n": Limit(ge=1, le=MAX_N),
    "temperature": Limit(ge=0.0, le=2.0),
    # Below 1e-6 top_p keeps only the top token, like greedy; tiny floats only underflow.
    "top_p": Limit(ge=1e-6, le=1.0),
    "top_k": Limit(ge=-1, le=INT32_MAX),  # -1 or 0: off
    "min_p": Limit(ge=0.0, le=1.0),
    "presence_penalty": Limit(ge=-2.0, le=2.0),
    "frequency_penalty": Limit(ge=-2.0, le=2.0),
    # Dividing logits by a near-zero penalty overflows them to inf.
    "repetition_penalty": Limit(ge=0.01, le=2.0),
    "max_tokens": Limit(ge=1, le=INT32_MAX),
    "min_tokens": Limit(ge=0, le=INT32_MAX),
    "logprobs": Limit(ge=0, le=MAX_LOGPROBS),
    "seed": Limit(ge=-(2**63), lt=2**64),
    "logit_bias": Limit(ge=-100.0, le=100.0),  # each value
    "token_id": Limit(ge=0, le=INT32_MAX),  # before the model's own vocabulary bound
}


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs; 0 = only the chosen token's
    skip_special_tokens: bool = True
    # vLLM's per-request KV transfer (prefill/decode disaggregation): do_remote_decode on the prefill
    # side; do_remote_prefill with the producer's remote_* fields on the decode side (runtime/kv/).
    kv_transfer_params: dict[str, Any] | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias; -100 bans).
    logit_bias: dict[int, float] | None = None
    # Sample only among these token ids (vLLM's allowed_token_ids); None: all.
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # vLLM's habits: one stop string, or None for none (as the OpenAI API's null).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def token_id_fields(self) -> dict[str, list[int]]:
        """Every client-supplied token id, by the parameter that carries it."""
        return {
            "stop_token_ids": list(self.stop_token_ids),
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": list(self.allowed_token_ids or []),
        }

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ``ValueError`` naming the parameter and its allowed range; return self.

        With ``vocab_size``, every token id the request carries must also be below it: the
        sampler indexes the logits with them on the device, where an id out of range is a
        device-side assert that takes the whole process down, not an error for one request.
        """

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def check(name: str, integer: bool = False) -> None:
            value = getattr(self, name)
            if integer and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(name, f"an integer {LIMITS[name].describe()}")
            if not isinstance(value, int | float) or value != value or not LIMITS[name].holds(value):
                raise bad(name, ("an integer " if integer else "") + LIMITS[name].describe())

        check("n", integer=True)
        check("temperature")
        check("top_p")
        if not isinstance(self.top_k, int) or not LIMITS["top_k"].holds(self.top_k):
            raise bad("top_k", "-1 or 0 (off) or a positive integer")
        check("min_p")
        check("presence_penalty")
        check("frequency_penalty")
        check("repetition_penalty")
        if self.max_tokens is not None:
            check("max_tokens", integer=True)
        check("min_tokens", integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} max_tokens={self.max_tokens}"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if self.logprobs is not None:
            check("logprobs", integer=True)
        if self.seed is not None:
            check("seed", integer=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"a mapping of at most {MAX_LOGIT_BIAS} token ids to biases")
            limit = LIMITS["logit_bias"]
            if any(
                not isinstance(v, int | float) or v != v or not limit.holds(v)
                for v in self.logit_bias.values()
            ):
                raise bad("logit_bias", f"a mapping of token ids to biases {limit.describe()}")
        if (
            self.allowed_token_ids is not None
            and not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
        ):
            raise bad("allowed_token_ids", f"None or a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", "a JSON object or None")
        ids_limit = LIMITS["token_id"]
        top = vocab_size - 1 if vocab_size is not None else None
        for name, ids in self.token_id_fields().items():
            if any(not isinstance(t, int) or isinstance(t, bool) or not ids_limit.holds(t) for t in ids):
                raise bad(name, "token ids >= 0")
            if top is not None and any(t > top for t in ids):
                outside = sorted({t for t in ids if t > top})[:5]
                raise ValueError(
                    f"{name} has token ids {outside} outside this model's vocabulary (0..{top}); "
                    "send ids in that range"
                )
        return self
