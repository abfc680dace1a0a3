"""HTTP answers read with a byte cap: what the operator and the router read from replica pods.

What it is: :func:`fetch_capped`, one request whose answer is read as it streams in
and abandoned (connection closed) once it passes ``limit`` bytes, returned as an
ordinary ``httpx.Response`` so callers keep using ``.text``, ``.json()`` and
``.raise_for_status()``. It asks for an uncompressed answer and refuses a compressed
one, so the cap counts the bytes that end up in memory (a small gzip body can inflate
a thousandfold). A replica is code the cluster's users choose (any image); the
operator serves every LLMService from one process, so one replica streaming
gigabytes must cost it at most ``limit`` bytes.

What it is not: a client of its own (callers pass their ``httpx.AsyncClient``) or a
retry policy.
"""

from __future__ import annotations

from typing import Any

import httpx

# Byte caps on what the operator and router read from a replica.
METRICS_LIMIT_BYTES = 4 * 1024 * 1024  # a replica's /metrics is tens of KiB
MODELS_LIMIT_BYTES = 1024 * 1024  # /v1/models with a few hundred adapters
SMALL_LIMIT_BYTES = 64 * 1024  # control answers (/drain, /slo, LoRA load, /hold)


class ResponseTooLarge(httpx.HTTPError):
    """The answer passed its byte cap (or came compressed); nothing more of it was read."""


async def fetch_capped(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    limit: int,
    *,
    json: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float | httpx.Timeout | None = None,
) -> httpx.Response:
    """``method url`` through ``client``; the answer holds at most ``limit`` bytes or ResponseTooLarge is raised."""
    sent = {"Accept-Encoding": "identity", **(headers or {})}
    kwargs: dict[str, Any] = {"json": json, "headers": sent}
    if timeout is not None:
        kwargs["timeout"] = timeout
    async with client.stream(method, url, **kwargs) as response:
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise ResponseTooLarge(f"{url} answered with Content-Encoding {encoding}; only identity is read")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ResponseTooLarge(f"{url} answered {declared} bytes, over the {limit}-byte cap")
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise ResponseTooLarge(f"{url} answered more than {limit} bytes; the rest was not read")
    kept = {
        k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "transfer-encoding")
    }
    return httpx.Response(response.status_code, headers=kept, content=bytes(body), request=response.request)
