"""The operator's HTTP client to the pods it manages: byte caps on every answer, the admin key on control calls.

What it is: :class:`ReplicaClient`, the one way handlers call a replica (or router) pod:
``get_text`` (``/metrics``), ``get_json`` (``/v1/models``, ``/hold``), ``post``,
``put`` and ``delete`` (``/drain``, ``/slo``, LoRA load and unload). Every answer is
read with a byte cap (``plimsoll.bounded_http``): the engine image is the user's choice,
and one pod streaming gigabytes must not take down the operator every LLMService
shares. The LLMService's admin key (``handlers/credentials.py``) goes only to control
paths and ``/v1/*``, never to ``/metrics`` or ``/hold``.

What it is not: a connection pool of its own (it wraps the caller's ``httpx.AsyncClient``)
or a retry policy; errors are ``httpx.HTTPError`` (``ResponseTooLarge`` among them), as before.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx

from plimsoll.auth import is_admin_path
from plimsoll.bounded_http import METRICS_LIMIT_BYTES, MODELS_LIMIT_BYTES, SMALL_LIMIT_BYTES, fetch_capped
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.credentials import admin_key
from plimsoll.operator.handlers.kube import Kube


class ReplicaClient:
    """Capped, authenticated calls to one LLMService's pods."""

    def __init__(self, http: httpx.AsyncClient, admin_api_key: str | None = None) -> None:
        self.http = http
        self.admin_api_key = admin_api_key

    @classmethod
    async def for_service(cls, kube: Kube, svc: LLMService, http: httpx.AsyncClient) -> ReplicaClient:
        """A client carrying ``svc``'s admin key (read from its Secret once, then cached)."""
        return cls(http, await admin_key(kube, svc))

    def _headers(self, method: str, url: str) -> dict[str, str]:
        path = urlsplit(url).path
        if self.admin_api_key and (is_admin_path(method, path) or path.startswith("/v1/")):
            return {"Authorization": f"Bearer {self.admin_api_key}"}
        return {}

    async def request(
        self, method: str, url: str, limit: int, json: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        response: httpx.Response = await fetch_capped(
            self.http, method, url, limit, json=json, headers=self._headers(method, url), timeout=timeout
        )
        return response

    async def get_text(self, url: str, limit: int = METRICS_LIMIT_BYTES, timeout: float | None = None) -> str:
        """The body of a 2xx GET as text; HTTPStatusError otherwise."""
        response = await self.request("GET", url, limit, timeout=timeout)
        response.raise_for_status()
        return response.text

    async def get_json(self, url: str, limit: int = MODELS_LIMIT_BYTES, timeout: float | None = None) -> Any:
        """The JSON body of a 2xx GET; HTTPStatusError or ValueError otherwise."""
        response = await self.request("GET", url, limit, timeout=timeout)
        response.raise_for_status()
        return response.json()

    async def post(self, url: str, json: Any = None, timeout: float | None = None) -> httpx.Response:
        return await self.request("POST", url, SMALL_LIMIT_BYTES, json=json, timeout=timeout)

    async def put(self, url: str, json: Any = None, timeout: float | None = None) -> httpx.Response:
        return await self.request("PUT", url, SMALL_LIMIT_BYTES, json=json, timeout=timeout)

    async def delete(self, url: str, timeout: float | None = None) -> httpx.Response:
        return await self.request("DELETE", url, SMALL_LIMIT_BYTES, timeout=timeout)
