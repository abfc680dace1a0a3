"""``--compilation-config``: whether the model's forward runs through ``torch.compile``, and where
its caches live. Pure settings (no torch import); ``engine/compilation.py`` acts on them.

What it is: vLLM's field names. ``mode`` (``level`` is the older name, accepted): 0 runs the
model eagerly, 3 compiles its forward with inductor (attention an opaque op, see
``engine/compilation.py``); unset means 3 on CUDA and 0 elsewhere (the CPU has its own native
decode paths). ``cache_dir``: the directory of inductor's FX-graph and AOT caches and of the
Triton kernels (``--compilation-cache-dir`` sets it; a volume there makes a restart skip the
compile). ``cudagraph_capture_sizes``: the decode batch sizes that get a CUDA graph (default
1, 2, 4, then multiples of 8 up to ``--max-num-seqs``).

What it is not: vLLM's other compilation knobs (custom passes, ``splitting_ops``,
``compile_sizes``); they are refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

COMPILATION_MODES = (0, 3)  # vLLM's CompilationMode.NONE and VLLM_COMPILE


class CompilationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: int | None = Field(
        None,
        description="0: eager; 3: torch.compile (inductor) of the forward with attention as an opaque op; "
        "unset: 3 on CUDA, 0 elsewhere (vLLM's compilation mode; 'level' is accepted for it)",
    )
    cache_dir: str | None = Field(
        None,
        description="directory for inductor's FX-graph/AOT caches and the Triton kernels (mount a volume "
        "there so a restart does not compile again); unset: inductor's default under the temp dir",
    )
    cudagraph_capture_sizes: list[int] | None = Field(
        None,
        description="decode batch sizes captured as CUDA graphs (default 1, 2, 4, 8, 16, ... max_num_seqs)",
    )

    @model_validator(mode="before")
    @classmethod
    def _level_is_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and "level" in data:
            data = dict(data)
            level = data.pop("level")
            if data.get("mode") not in (None, level):
                raise ValueError(f"compilation config gives level={level} and mode={data['mode']}; give one")
            data["mode"] = level
        return data

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: int | None) -> int | None:
        if value is not None and value not in COMPILATION_MODES:
            raise ValueError(
                f"compilation mode {value} is not supported; use 0 (eager) or 3 (torch.compile with "
                "attention as an opaque op)"
            )
        return value

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 1):
            raise ValueError(f"cudagraph_capture_sizes must be positive batch sizes, got {value}")
        return None if value is None else sorted(set(value))

    def resolved_mode(self, device_type: str) -> int:
        """The mode this engine runs: the one given, else 3 on CUDA and 0 elsewhere."""
        if self.mode is not None:
            return self.mode
        return 3 if device_type == "cuda" else 0

    @classmethod
    def parse(cls, value: object) -> object:
        """A config, a dict, a JSON object string, or a bare mode number (``-O 3`` style)."""
        if isinstance(value, str):
            text = value.strip()
            if text.lstrip("-").isdigit():
                return {"mode": int(text)}
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(
                    f"--compilation-config must be a JSON object (e.g. '{{\"mode\": 3}}') or a mode number, "
                    f"got {value!r}: {exc}"
                ) from None
        if isinstance(value, int) and not isinstance(value, bool):
            return {"mode": value}
        return value
