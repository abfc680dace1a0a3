"""Who may call what on a replica or the router: the two credentials and the admin paths.

What it is: the one list of control paths (drain, SLO, sleep and wake, run-time LoRA loading,
``/debug/*``) that need the *admin* credential rather than the inference API key,
the environment variables the command lines read both from (so a key can come from a
Kubernetes Secret without appearing in a pod's args or ``/proc/*/cmdline``), and the
constant-time ``Authorization: Bearer`` check the runtime server and the router share.
The operator's HTTP client to replicas uses :func:`is_admin_path` to pick which key
to send.

What it is not: the middleware (``runtime/serving/auth.py``, the router's app) or
key storage (the operator keeps the admin key in a Secret per LLMService).
"""

from __future__ import annotations

import hmac
import ipaddress

API_KEY_ENV = "PLIMSOLL_API_KEY"
# A key for POST /wake_up alone (besides the admin key): what a router holds to wake a parked replica,
# so it never holds the key to every control endpoint.
WAKE_API_KEY_ENV = "PLIMSOLL_WAKE_API_KEY"
WAKE_PATH = "/wake_up"
ADMIN_API_KEY_ENV = "PLIMSOLL_ADMIN_API_KEY"
# The shared KV tier server's password (Valkey/Redis AUTH): the replica reads it, the operator sets it.
KV_SHARED_PASSWORD_ENV = "PLIMSOLL_KV_SHARED_PASSWORD"

# Exact paths whose every method is a control action, and (method, path) pairs for
# paths that also have a harmless read (GET /slo stays open, as /metrics does).
ADMIN_PATHS = frozenset(
    {"/drain", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/sleep", "/wake_up"}
)
ADMIN_METHOD_PATHS = frozenset({("PUT", "/slo")})
ADMIN_PREFIXES = ("/debug/",)


def is_admin_path(method: str, path: str) -> bool:
    """Whether ``method path`` is a control endpoint (needs the admin credential)."""
    return (
        path in ADMIN_PATHS
        or (method.upper(), path) in ADMIN_METHOD_PATHS
        or path.startswith(ADMIN_PREFIXES)
        or path == "/debug"
    )


def bearer_matches(header: bytes | str | None, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    given = header.encode() if isinstance(header, str) else (header or b"")
    return hmac.compare_digest(given, f"Bearer {key}".encode())


def is_loopback(host: str | None) -> bool:
    """A client on this machine (127.0.0.0/8, ::1); an unknown or non-IP host is not."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
