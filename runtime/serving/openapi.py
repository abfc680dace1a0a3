"""The server's OpenAPI schema with every response it can give, not only the happy path.

What it is: :func:`install_openapi`, which replaces FastAPI's generated schema with one
that generated clients and gateways can trust: the error body every non-2xx answer
carries (``ErrorResponse``), 400 instead of FastAPI's 422 (the error handlers turn
validation errors into OpenAI's 400), 413 wherever a body is read, 401 on the paths
the API key guards, each route's own statuses (404, 409, 429, 503, 504 …) with their
``Retry-After`` headers, the probes' 503 bodies, ``/metrics`` as Prometheus text, the
LoRA endpoints' plain-text answers and ``/debug/profile``'s query parameters.
A schemathesis run with every check (``tests/runtime/serving/test_openapi_conformance.py``)
holds the schema to what the server really returns.

What it is not: the routes (``server.py``) or the error rendering (``errors.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from plimsoll.auth import is_admin_path
from plimsoll.runtime.serving.protocol import ChatCompletionResponse, CompletionResponse, ErrorResponse

# The paths ``--api-key`` guards (the probes and /metrics stay open for the kubelet and Prometheus).
API_KEY_PREFIXES = ("/v1", "/debug")
_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}
}

# Status -> why, shared by every operation that can answer it.
WHY = {
    400: "The request is invalid; the error names the field (param) and says what to send instead.",
    401: "The API key is missing or wrong (the server runs with --api-key); send `Authorization: Bearer KEY`.",
    403: "A control endpoint: it needs the admin key (`Authorization: Bearer ADMIN_KEY`, --admin-api-key); "
    "without one configured only clients on the replica's own host may call it.",
    404: "Not found; the error says what exists.",
    409: "Busy with the same operation; retry when it finishes.",
    413: "The request body is larger than --max-request-bytes.",
    429: "Over a limit (the waiting queue, a tenant's in-flight tokens, the template workers); "
    "retry after Retry-After.",
    500: "The engine failed on this request.",
    501: "Not available in this build of the server.",
    503: "Not serving now: the model is loading, the engine failed, or the replica drains; retry after "
    "Retry-After (or on another replica).",
    504: "The request ran past --request-timeout and was aborted.",
}
_RETRYABLE = (429, 503)

# Each operation's own statuses beyond the generic ones (a body: 400 and 413; the API key: 401).
OPERATION_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/completions"): (404, 429, 500, 503, 504),
    ("post", "/v1/chat/completions"): (404, 429, 500, 503, 504),
    ("post", "/v1/load_lora_adapter"): (404, 503),
    ("post", "/v1/unload_lora_adapter"): (404, 503),
    ("post", "/debug/profile"): (400, 404, 409, 500, 501, 503),
}
_PROBE_503 = {
    ("get", "/health"): {
        "description": "The engine failed; the process drains and exits.",
        "example": {"status": "engine failed"},
    },
    ("get", "/ready"): {
        "description": "Not ready: loading (with startup phases), draining, marked for removal, or failed.",
        "example": {"ready": False, "reason": "loading"},
    },
}
_TEXT_200 = {
    ("get", "/metrics"): ("text/plain", "Prometheus text exposition of the server's metrics."),
    ("post", "/v1/load_lora_adapter"): ("text/plain", "Success: the adapter is loaded."),
    ("post", "/v1/unload_lora_adapter"): ("text/plain", "Success: the adapter is unloaded."),
}
# The completion endpoints answer JSON, or with "stream": true Server-Sent Events.
_COMPLETION_BODIES = {
    ("post", "/v1/completions"): CompletionResponse,
    ("post", "/v1/chat/completions"): ChatCompletionResponse,
}
# One Server-Sent Event: its data is a chunk's JSON, or [DONE] at the end.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "A chunk as JSON, then [DONE]."}},
    "required": ["data"],
}
_PROFILE_QUERY = [
    {
        "name": "seconds",
        "in": "query",
        "required": True,
        "description": "How long to record (1 to 300 s).",
        "schema": {"type": "number", "minimum": 1, "maximum": 300},
    },
    {
        "name": "kind",
        "in": "query",
        "required": False,
        "description": "torch (Chrome trace JSON) or py-spy (flame graph SVG).",
        "schema": {"type": "string", "enum": ["torch", "py-spy"], "default": "torch"},
    },
]


def _error(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": WHY[status],
        "content": {"application/json": {"schema": _ERROR}},
    }
    if status in _RETRYABLE:
        response["headers"] = _RETRY_AFTER
    return response


def statuses_for(method: str, path: str, has_body: bool) -> list[int]:
    """Every non-2xx status ``method path`` can answer, in order."""
    found = set(OPERATION_STATUSES.get((method, path), ()))
    if has_body:
        found |= {400}
    if method not in ("get", "head"):
        found |= {413}  # the body limit reads every request that may carry one
    if path.startswith(API_KEY_PREFIXES):
        found |= {401}
    if is_admin_path(method, path):
        found |= {401, 403}
    return sorted(found)


def _component(components: dict[str, Any], model: Any) -> dict[str, str]:
    """Put ``model``'s JSON schema (and the models it uses) into ``components``; its ``$ref``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def document_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """Add every response the server gives to FastAPI's generated ``schema`` (in place; returned)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _component(components, ErrorResponse)
    for component in ("HTTPValidationError", "ValidationError"):
        components.pop(component, None)  # FastAPI's 422 body, which this server never sends
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if (method, path) == ("post", "/debug/profile"):
                operation["parameters"] = _PROFILE_QUERY
            has_body = "requestBody" in operation or bool(operation.get("parameters"))
            for status in statuses_for(method, path, has_body):
                responses[str(status)] = _error(status)
            if (method, path) in _PROBE_503:
                probe = _PROBE_503[(method, path)]
                responses["503"] = {
                    "description": probe["description"],
                    "content": {
                        "application/json": {"schema": {"type": "object"}, "example": probe["example"]}
                    },
                }
            if (method, path) in _TEXT_200:
                media, why = _TEXT_200[(method, path)]
                responses["200"] = {"description": why, "content": {media: {"schema": {"type": "string"}}}}
            if (method, path) in _COMPLETION_BODIES:
                responses["200"] = {
                    "description": "The completion; with stream=true, Server-Sent Events (`data: {chunk}` lines, "
                    "then `data: [DONE]`).",
                    "content": {
                        "application/json": {
                            "schema": _component(components, _COMPLETION_BODIES[(method, path)])
                        },
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                }
            if (method, path) == ("post", "/debug/profile"):
                responses["200"] = {
                    "description": "The profile: a Chrome trace (torch) or a flame graph (py-spy).",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "image/svg+xml": {"schema": {"type": "string"}},
                    },
                }
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve the documented schema at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generated = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = document_responses(generated)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
