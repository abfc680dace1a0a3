"""OpenAI-shaped errors: one exception type and the FastAPI handlers that render it.

Every error the server returns has the body
``{"error": {"message", "type", "param", "code"}}``. FastAPI's own 422 for
request validation is turned into a 400 whose message names the field and says
what to send instead, because OpenAI clients treat 400 as "fix your request".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plimsoll.runtime.serving.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("plimsoll.runtime.serving.server")

# HTTP status -> the error "type" OpenAI's clients and vLLM use for it.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class APIError(Exception):
    """An error to return to the client as-is (status, message, offending param)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(
            message=self.message,
            type=ERROR_TYPES.get(self.status, "Error"),
            param=self.param,
            code=self.status,
        )
        body: dict[str, Any] = ErrorResponse(error=info).model_dump()
        return body

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable sentence per pydantic error, and the first offending field."""
    parts: list[str] = []
    first_param: str | None = None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # pydantic puts the union member tried in the location ("str", "list[int]"); drop those
        # so the message names the field the client wrote.
        field = ".".join(x for x in loc if not any(c in x for c in "[]()") and x not in {"str", "int"})
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}) or {}
            parts.append(
                f"the body is not valid JSON ({ctx.get('error', 'parse error')}); send a JSON object"
            )
            continue
        if field == "" and err.get("type") in {"model_attributes_type", "dict_type", "model_type"}:
            parts.append("the body must be a JSON object")
            continue
        if field == "" and err.get("type") == "missing":
            parts.append("a JSON body is required")
            continue
        first_param = first_param or (field or None)
        msg = str(err.get("msg", "invalid value"))
        if "input" in err and err.get("type") != "missing":
            shown = repr(err["input"])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            parts.append(f"`{field}`: {msg} (got {shown})")
        else:
            parts.append(f"`{field}`: {msg}")
    if len(errors) > 5:
        parts.append(f"and {len(errors) - 5} more")
    return "Invalid request: " + "; ".join(dict.fromkeys(parts)) + ".", first_param


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves at the request's path (for a 405's ``Allow``)."""
    from starlette.routing import Match

    methods: set[str] = set()
    scope = {**request.scope, "method": "GET"}
    for route in request.app.router.routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(scope)[0] != Match.NONE:
            methods |= set(route_methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Render every error, including FastAPI's and Starlette's own, as OpenAI does."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc.errors())
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail) if exc.detail else "HTTP error"
        message = f"{detail}: {request.method} {request.url.path}; the API is described at /docs"
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            # Starlette names only the first route matching the path; list every method the path has.
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        return APIError(exc.status_code, message, headers=headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Anything else is a plimsoll bug; say so without leaking internals, and log it.
        log.exception("unhandled error while serving a request")
        return APIError(500, f"internal error: {type(exc).__name__}; see the server log").response()
