"""One validated configuration for a bench run, built at the CLI edge and passed down.

What it is: the workload shape (token lengths, shared prefixes), the load plan
(levels, requests or duration per level, repeats), SLOs, validity-gate limits and
the headroom used for the recommendation. What it is not: any I/O.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_LEVELS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


class BenchInputError(ValueError):
    """The user gave something we cannot run; the message says what and how to fix it."""


class LengthSpec(BaseModel):
    """A token length: fixed, or drawn per request from a distribution.

    Written on the command line as ``128``, ``uniform:64:256``, ``normal:128:32``
    (mean, std; clipped to >= 1) or ``choice:64,512,2048``.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["fixed", "uniform", "normal", "choice"] = "fixed"
    value: int = 128
    low: int = 0
    high: int = 0
    mean: float = 0.0
    std: float = 0.0
    choices: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | int) -> LengthSpec:
        """Parse the command-line form; raise BenchInputError with the accepted forms."""
        if isinstance(text, int):
            text = str(text)
        hint = "use N, uniform:LOW:HIGH, normal:MEAN:STD or choice:A,B,C (all positive integers)"
        try:
            if ":" not in text:
                spec = cls(kind="fixed", value=int(text))
            else:
                kind, _, rest = text.partition(":")
                if kind == "uniform":
                    low, high = (int(v) for v in rest.split(":"))
                    spec = cls(kind="uniform", low=low, high=high)
                elif kind == "normal":
                    mean, std = (float(v) for v in rest.split(":"))
                    spec = cls(kind="normal", mean=mean, std=std)
                elif kind == "choice":
                    spec = cls(kind="choice", choices=tuple(int(v) for v in rest.split(",")))
                else:
                    raise ValueError(kind)
        except ValueError as exc:
            raise BenchInputError(f"cannot read token length {text!r}: {hint}") from exc
        spec.check(text, hint)
        return spec

    def check(self, text: str, hint: str) -> None:
        ok = {
            "fixed": self.value >= 1,
            "uniform": 1 <= self.low <= self.high,
            "normal": self.mean >= 1 and self.std >= 0,
            "choice": bool(self.choices) and min(self.choices) >= 1,
        }[self.kind]
        if not ok:
            raise BenchInputError(f"token length {text!r} is out of range: {hint}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.mean, self.std)))
        return rng.choice(self.choices)

    def describe(self) -> str:
        return {
            "fixed": f"{self.value}",
            "uniform": f"uniform:{self.low}:{self.high}",
            "normal": f"normal:{self.mean:g}:{self.std:g}",
            "choice": "choice:" + ",".join(str(c) for c in self.choices),
        }[self.kind]

    def upper(self) -> int:
        """A generous upper bound, used for sizing prompts and timeouts."""
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return self.high
        if self.kind == "normal":
            return round(self.mean + 4 * self.std)
        return max(self.choices)


class SLO(BaseModel):
    """Service-level objectives in milliseconds; any subset may be set."""

    model_config = ConfigDict(frozen=True)

    ttft_p95_ms: float | None = Field(default=None, gt=0)
    tpot_p50_ms: float | None = Field(default=None, gt=0)
    e2e_p95_ms: float | None = Field(default=None, gt=0)

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_p95_ms, self.tpot_p50_ms, self.e2e_p95_ms))


class BenchConfig(BaseModel):
    """Everything one `plimsoll bench` invocation needs, validated once."""

    model_config = ConfigDict(frozen=True)

    url: str
    model: str | None = None
    # --models a,b,c: requests cycle through these (an even mix, e.g. a base model and its LoRA adapters).
    models: tuple[str, ...] = ()
    api_key: str | None = None
    endpoint: Literal["completions", "chat"] = "completions"
    input_tokens: LengthSpec = LengthSpec(value=128)
    output_tokens: LengthSpec = LengthSpec(value=64)
    shared_prefix_tokens: int = Field(default=0, ge=0)
    shared_prefix_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    ignore_eos: bool = True
    levels: tuple[int, ...] = DEFAULT_LEVELS
    requests_per_level: int | None = Field(default=None, ge=1)
    duration_per_level_s: float | None = Field(default=None, gt=0)
    # A floor under request mode: a level ends at its request count *and* after this many seconds,
    # so a fast server is measured for minutes, not one or two synchronised waves.
    min_duration_per_level_s: float | None = Field(default=None, ge=0)
    warmup_requests: int | None = Field(default=None, ge=0)
    repeats: int = Field(default=1, ge=1)
    request_timeout_s: float = Field(default=120.0, gt=0)
    slo: SLO = SLO()
    headroom: float = Field(default=0.75, gt=0.0, le=1.0)
    throughput_alpha: float = Field(default=0.9, gt=0.0, lt=1.0)
    # Validity gates (see docs/bench.md): a level failing any is never used for knees.
    max_error_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    min_concurrency_ratio: float = Field(default=0.95, gt=0.0, le=1.0)
    # Event-loop lag p99 above which the client itself is the bottleneck. The
    # reference's 10 ms assumes a dedicated load-generator host.
    max_client_lag_ms: float = Field(default=50.0, gt=0)
    # Event-loop lag p99 above which a (still valid) level is marked disturbed: the host was busy.
    disturbed_client_lag_ms: float = Field(default=20.0, gt=0)
    # After the sweep, hold the recommendation this long and step down until it holds (0 = no hold).
    verify_seconds: float = Field(default=0.0, ge=0)
    scrape_interval_s: float = Field(default=0.5, gt=0)
    seed: int = 0

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @field_validator("levels")
    @classmethod
    def _levels(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or min(value) < 1:
            raise ValueError("concurrency levels must be positive integers, e.g. 1,2,4,8")
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _prefix(self) -> BenchConfig:
        if self.shared_prefix_fraction > 0 and self.shared_prefix_tokens == 0:
            raise ValueError("--shared-prefix-fraction needs --shared-prefix-tokens > 0")
        if self.models and self.model is not None:
            raise ValueError("give --model (one model) or --models (a mix), not both")
        if self.min_duration_per_level_s and self.duration_per_level_s is not None:
            raise ValueError(
                "--min-duration-per-level is a floor under the request count; with --duration-per-level "
                "the duration already decides, so pass one of them"
            )
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"--models names a model twice: {','.join(self.models)}")
        return self

    def measured_requests(self, concurrency: int) -> int | None:
        """Requests measured per level in request mode: at least one per client."""
        if self.requests_per_level is None:
            return None if self.duration_per_level_s is not None else max(100, 4 * concurrency)
        return max(self.requests_per_level, concurrency)

    def warmup_for(self, concurrency: int) -> int:
        """Completions excluded as warm-up: by default one round, one per client."""
        return concurrency if self.warmup_requests is None else self.warmup_requests


def parse_models(text: str | None) -> tuple[str, ...]:
    """Parse ``--models a,b,c`` (at least two names; one model is --model)."""
    if text is None:
        return ()
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    if len(models) < 2:
        raise BenchInputError(f"--models {text!r} needs two or more comma-separated model names (one is --model)")
    return models


def parse_duration(text: str) -> float:
    """``600``, ``600s``, ``45m`` or ``1h`` in seconds, with a clear error."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    value = text.strip().lower()
    scale = units.get(value[-1:])
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError as exc:
        raise BenchInputError(f"cannot read duration {text!r}: use seconds or 45m, 1h") from exc
    if seconds <= 0:
        raise BenchInputError(f"duration {text!r} must be positive")
    return seconds


def parse_levels(text: str) -> tuple[int, ...]:
    """Parse ``1,2,4,8`` into a tuple, with a clear error."""
    try:
        levels = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise BenchInputError(
            f"cannot read levels {text!r}: use comma-separated integers like 1,2,4,8"
        ) from exc
    if not levels or min(levels) < 1:
        raise BenchInputError(f"levels {text!r} must be positive integers like 1,2,4,8")
    return levels
