"""Async streaming client for OpenAI-compatible servers, timing every chunk.

What it is: one :class:`OpenAIClient` over ``httpx.AsyncClient`` that sends
``/v1/completions`` or ``/v1/chat/completions`` with ``stream=true`` and
``stream_options.include_usage``, and fills a :class:`RequestRecord` (send, first
token, every chunk, end; token counts from ``usage``; error kind). Plus the
pre-flight checks that turn an unreachable URL, a wrong model or an erroring
server into a clear :class:`BenchError` before any load is sent, and the token
calibration. What it is not: a load generator (see loadgen.py).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from plimsoll.bench.config import BenchConfig
from plimsoll.bench.workload import WORDS, RequestSpec, TokenFit


class BenchError(RuntimeError):
    """The server or URL cannot be benchmarked; the message says why and what to do."""


@dataclass(slots=True)
class RequestRecord:
    """Timings (``time.perf_counter`` seconds) and outcome of one request."""

    request_id: int
    scheduled: float
    input_tokens_target: int = 0
    max_tokens: int = 0
    sent: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error_kind: str | None = None
    error_message: str | None = None
    measured: bool = False
    model: str | None = None  # the model asked for (one of --models in a mix)

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.end is not None and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def n_output(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) / (n − 1); None for single-token answers."""
        if not self.ok or self.n_output < 2:
            return None
        assert self.end is not None and self.first_token is not None
        return (self.end - self.first_token) / (self.n_output - 1)

    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def send_lag(self) -> float:
        return self.sent - self.scheduled

    def as_json(self, origin: float) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - origin, 6)

        return {
            "request_id": self.request_id,
            "model": self.model,
            "measured": self.measured,
            "ok": self.ok,
            "scheduled_s": rel(self.scheduled),
            "sent_s": rel(self.sent),
            "first_token_s": rel(self.first_token),
            "end_s": rel(self.end),
            "ttft_ms": None if self.ttft is None else self.ttft * 1e3,
            "tpot_ms": None if self.tpot is None else self.tpot * 1e3,
            "e2e_ms": None if self.e2e is None else self.e2e * 1e3,
            "chunks": len(self.chunk_times),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "input_tokens_target": self.input_tokens_target,
            "max_tokens": self.max_tokens,
            "error_kind": self.error_kind,
            "error_message": self.error_message,
        }


def _error_text(response: httpx.Response, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return body.decode(errors="replace")[:300] or response.reason_phrase


class OpenAIClient:
    """Sends requests to one server and times them."""

    def __init__(self, cfg: BenchConfig, model: str, models: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.model = model
        # A mix: request i asks for models[i % len(models)], so every level sends an even mix.
        self.models = models or (model,)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(
            base_url=cfg.url,
            headers=headers,
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=10.0),
            # No pool cap: the load generator, not the pool, sets concurrency.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
        )
        self.path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"

    async def aclose(self) -> None:
        await self.http.aclose()

    def payload(self, spec: RequestSpec, stream: bool = True, model: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model or self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.cfg.ignore_eos:
            # vLLM/plimsoll extension: generate exactly max_tokens so lengths are the workload's.
            body["ignore_eos"] = True
        return body

    async def send(self, spec: RequestSpec, record: RequestRecord) -> RequestRecord:
        """Stream one request, filling ``record``; never raises for server or network faults."""
        record.input_tokens_target = spec.input_tokens
        record.max_tokens = spec.max_tokens
        record.model = self.models[max(record.request_id, 0) % len(self.models)]
        record.sent = time.perf_counter()
        try:
            async with self.http.stream("POST", self.path, json=self.payload(spec, model=record.model)) as response:
                if response.status_code != 200:
                    body = await response.aread()
                    record.error_kind = f"http_{response.status_code}"
                    record.error_message = _error_text(response, body)
                    record.end = time.perf_counter()
                    return record
                await self._read_stream(response, record)
        except httpx.TimeoutException as exc:
            record.error_kind, record.error_message = (
                "timeout",
                f"{type(exc).__name__} after {self.cfg.request_timeout_s:g} s",
            )
        except httpx.ConnectError as exc:
            record.error_kind, record.error_message = "connect", str(exc) or type(exc).__name__
        except httpx.HTTPError as exc:
            record.error_kind, record.error_message = "transport", str(exc) or type(exc).__name__
        if record.error_kind is None and record.end is None:
            record.error_kind, record.error_message = "protocol", "stream ended without [DONE]"
        if record.error_kind is not None and record.end is None:
            record.end = time.perf_counter()  # when it failed: the request stops counting as in flight
        return record

    async def _read_stream(self, response: httpx.Response, record: RequestRecord) -> None:
        first_event: float | None = None  # the first chunk with a choice, text or not
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            if data == "[DONE]":
                record.end = now
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                record.error_kind, record.error_message = "protocol", f"unparseable SSE data: {data[:120]}"
                return
            if "error" in event:
                err = event["error"]
                record.error_kind = "stream_error"
                record.error_message = str(err.get("message") if isinstance(err, dict) else err)
                return
            if event.get("choices") and first_event is None:
                first_event = now
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text = choice.get("text") if "text" in choice else delta.get("content")
                if text:
                    record.chunk_times.append(now)
                    if record.first_token is None:
                        record.first_token = now
                    break
            usage = event.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = usage.get("completion_tokens")
        if record.end is not None and record.first_token is None:
            if record.output_tokens and first_event is not None:
                # Tokens were generated that decode to no visible text (a byte-level model's half of a
                # UTF-8 character is held back, as vLLM's detokenizer does): the first chunk is the answer.
                record.first_token = first_event
            else:
                record.error_kind, record.error_message = (
                    "empty",
                    "the server finished without streaming any token",
                )


async def served_models(http: httpx.AsyncClient) -> list[str]:
    """The model ids from /v1/models, or a BenchError saying why not."""
    try:
        response = await http.get("/v1/models", timeout=10.0)
    except httpx.TransportError as exc:
        raise BenchError(
            f"cannot reach {http.base_url} ({type(exc).__name__}: {exc}); is the server running and is --url right?"
        ) from exc
    if response.status_code in (401, 403):
        raise BenchError(f"{http.base_url}/v1/models answered {response.status_code}: pass --api-key")
    if response.status_code != 200:
        raise BenchError(
            f"{http.base_url}/v1/models answered HTTP {response.status_code}: {_error_text(response, response.content)}; "
            "is this an OpenAI-compatible server?"
        )
    try:
        return [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{http.base_url}/v1/models did not return an OpenAI model list") from exc


async def resolve_model(cfg: BenchConfig) -> str:
    """The model to benchmark: --model if the server serves it, else its only model.

    With --models, every one must be served; the first is returned (the probe's model).
    """
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers) as http:
        models = await served_models(http)
    missing = [m for m in cfg.models if m not in models]
    if missing:
        raise BenchError(f"the server does not serve {missing}; it serves {models}. Fix --models.")
    if cfg.models:
        return cfg.models[0]
    if cfg.model is not None:
        if cfg.model not in models:
            raise BenchError(
                f"the server does not serve model {cfg.model!r}; it serves {models}. Fix --model."
            )
        return cfg.model
    if len(models) != 1:
        raise BenchError(f"the server serves {models}; choose one with --model")
    return models[0]


async def probe(client: OpenAIClient, words: int, max_tokens: int = 2) -> RequestRecord:
    """One small request; raise BenchError with the server's message if it fails."""
    spec = RequestSpec(" ".join(WORDS[i % len(WORDS)] for i in range(words)), words, max_tokens, False)
    rec = await client.send(spec, RequestRecord(-1, time.perf_counter()))
    if not rec.ok:
        hint = ""
        if rec.error_kind == "http_400" and "ignore_eos" in (rec.error_message or ""):
            hint = " (the server rejects ignore_eos: pass --no-ignore-eos)"
        raise BenchError(
            f"test request to {client.cfg.url}{client.path} failed: "
            f"{rec.error_kind}: {rec.error_message}{hint}"
        )
    return rec


async def calibrate(client: OpenAIClient) -> TokenFit:
    """Fit prompt tokens per word from two probes' ``usage.prompt_tokens``."""
    small, large = await probe(client, 16), await probe(client, 64)
    if small.prompt_tokens is None or large.prompt_tokens is None:
        return TokenFit(source="assumed: the server returned no usage")
    per_word = (large.prompt_tokens - small.prompt_tokens) / 48
    if per_word <= 0:
        return TokenFit(source="assumed: usage counts did not grow with the prompt")
    return TokenFit(
        offset=small.prompt_tokens - 16 * per_word, per_word=per_word, source="calibrated from usage"
    )
