"""The engine's one validated config object, and the byte-size parser it uses.

What it is: every knob the engine reads (model, limits, KV budget, policies),
checked once at the edge. What it is not: HTTP/server settings (those belong to
the server) or model hyper-parameters (those come from the model's own config).
"""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}

DEFAULT_MAX_MODEL_LEN_CAP = 4096


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB" -> 2147483648``; ``"512MB" -> 512000000``; plain numbers are bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size like '2GiB' or 1073741824, got {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"byte size must be positive, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot parse byte size {value!r}: use a number with an optional unit "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '2GiB'"
        )
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"byte size must be positive, got {value!r}")
    return size


class EngineConfig(BaseModel):
    """Validated engine settings. ``LLM(**fields)`` and ``plimsoll serve`` both build one."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str = Field(
        "smollm2-135m",
        description="HF-format directory, path to a .gguf file, or 'smollm2-135m' (embedded default)",
    )
    served_model_name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    kv_cache_memory: int = Field(1024**3, description="bytes for the paged KV cache (all layers, K and V)")
    block_size: int = Field(16, ge=1, le=1024)
    enable_prefix_caching: bool = True
    attention_backend: Literal["torch", "triton"] = "torch"
    scheduling_policy: Literal["continuous", "static"] = "continuous"
    seed: int = 0

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_kv_cache_memory(cls, value: object) -> int:
        if isinstance(value, str | int | float):
            return parse_bytes(value)
        raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")

    @property
    def torch_dtype(self) -> "torch.dtype":  # type: ignore[name-defined]  # noqa: F821
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def display_name(self) -> str:
        """The name clients use for this model (OpenAI ``model`` field)."""
        return self.served_model_name or self.model
