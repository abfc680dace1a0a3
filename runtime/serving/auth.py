"""Authentication of a replica's HTTP API: the inference key on ``/v1/*``, the admin key on control paths.

What it is: :class:`AuthMiddleware`, a plain ASGI middleware placed outside every
other one, so a request is refused before a byte of its body is read. Control paths
(``plimsoll.auth.is_admin_path``: ``/drain``, ``PUT /slo``, run-time LoRA loading,
``/debug/*``) need ``Authorization: Bearer <--admin-api-key>`` (``POST /wake_up`` also takes
``--wake-api-key``, the one key a router holds); without an admin key
configured they answer only clients on the loopback interface (a developer's own
machine, or another container of the same pod) and refuse everyone else with 403
saying to set ``--admin-api-key``. ``/v1/*`` needs ``--api-key`` when one is set (the
admin key is accepted there too, so the operator needs one credential). Probes,
``/metrics``, ``GET /slo`` and ``/version`` stay open: the kubelet and Prometheus call them.

What it is not: the keys' source (``cli.py`` reads flags and environment) or
authorisation beyond these two roles.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from plimsoll.auth import WAKE_PATH, bearer_matches, is_admin_path, is_loopback
from plimsoll.runtime.serving.errors import APIError

log = logging.getLogger("plimsoll.runtime.serving.auth")


class AuthMiddleware:
    """Refuse unauthenticated requests before anything reads them (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, admin_api_key: str | None, wake_api_key: str | None = None
    ) -> None:
        self.app = app
        # An empty key (an unset variable rendered as "") means no key, as before.
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        self.wake_api_key = wake_api_key or None

    def _refusal(self, scope: Scope) -> APIError | None:
        path, method = scope["path"], scope["method"]
        header = dict(scope["headers"]).get(b"authorization")
        if path == WAKE_PATH and method == "POST" and self.wake_api_key and bearer_matches(header, self.wake_api_key):
            return None  # the wake key opens this one path (a router waking a parked replica)
        if is_admin_path(method, path):
            if self.admin_api_key is None:
                client = scope.get("client")
                if is_loopback(client[0] if client else None):
                    return None
                log.warning("refused %s %s from %s: no --admin-api-key is set", method, path,
                            client[0] if client else "?")  # fmt: skip
                return APIError(
                    403,
                    f"{method} {path} is a control endpoint; this server has no admin key, so it answers "
                    "only loopback clients. Start it with --admin-api-key (or PLIMSOLL_ADMIN_API_KEY) and "
                    "send `Authorization: Bearer <admin key>`.",
                )
            if bearer_matches(header, self.admin_api_key):
                return None
            what = "missing" if not header else "wrong"
            return APIError(
                401, f"The admin key is {what}; {method} {path} needs `Authorization: Bearer <admin key>`."
            )
        if self.api_key is not None and path.startswith("/v1"):
            if bearer_matches(header, self.api_key) or (
                self.admin_api_key is not None and bearer_matches(header, self.admin_api_key)
            ):
                return None
            what = "missing" if not header else "wrong"
            return APIError(401, f"The API key is {what}; send the header `Authorization: Bearer <key>`.")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
