"""Per-request sampling and stopping parameters (the vLLM-shaped ``SamplingParams``).

What it is: plain data plus ``validate()``. What it is not: the sampling itself
(see ``sampler.py``), stop detection (see ``detokenizer.py`` and ``engine.py``), or
scheduling attributes: ``priority`` and the tenant belong to the request
(``Request``, ``LLMEngine.add_request``), as in vLLM.
"""

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20


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
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise ``ValueError`` naming the parameter and its allowed range; return self."""

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", ">= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 or 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} max_tokens={self.max_tokens}"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", "a JSON object or None")
        return self
