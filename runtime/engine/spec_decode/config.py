"""The ``--speculative-config`` object, vLLM's JSON interface.

What it is: ``SpeculativeConfig``, parsed from the JSON ``plimsoll serve
--speculative-config`` takes (or a dict given to ``LLM``): ``{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}`` or
``{"model": DIR, "num_speculative_tokens": 4}`` (``method`` is then ``"draft_model"``).
What it is not: the proposers or the verification (see the sibling modules).
"""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "draft_model"] | None = Field(
        None, description="'ngram' (prompt lookup) or 'draft_model'; inferred from 'model' when omitted"
    )
    model: str | None = Field(None, description="draft model: HF directory, .gguf file or embedded name")
    num_speculative_tokens: int = Field(..., ge=1, le=16, description="tokens proposed per step (k)")
    prompt_lookup_max: int | None = Field(None, ge=1, description="longest n-gram matched (ngram)")
    prompt_lookup_min: int | None = Field(None, ge=1, description="shortest n-gram matched (ngram)")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method is None:
            self.method = "draft_model" if self.model else None
        if self.method is None:
            raise ValueError('set "method": "ngram", or "model": DIR for a draft model')
        if self.method == "draft_model" and not self.model:
            raise ValueError('method "draft_model" needs "model": the draft model directory')
        if self.method == "ngram":
            if self.model:
                raise ValueError('method "ngram" takes no "model"; drop it or drop "method"')
            # As in vLLM, one bound given sets the other; with neither, match 1..4 tokens.
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo, hi = 1, 4
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            assert lo is not None and hi is not None
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        return self

    @classmethod
    def parse(cls, value: "str | dict[str, object] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """Accept the JSON text of ``--speculative-config``, a dict, an instance or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--speculative-config is not valid JSON ({exc.msg} at char {exc.pos}); "
                    'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        return cls.model_validate(value)
