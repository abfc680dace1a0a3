"""``kv_transfer_params`` at the HTTP edge: what a prefill/decode split may ask, and the address it answers with.

What it is: the checks that need the request as the client sent it (a prefill that hands its
blocks on returns them in one JSON body: one prompt, ``n = 1``, no stream) and, for a producer
whose transfer server binds every address, the host a decode replica should pull from: the
address this request reached the server on (a pod IP in a cluster), which is as reachable as
the router found it. What it is not: the protocol's engine side (``runtime/kv/remote_prefill.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from plimsoll.runtime.serving.errors import bad_request


def check_transfer_request(params: dict[str, Any] | None, num_prompts: int, stream: bool | None) -> None:
    """400 for a ``do_remote_decode`` request whose answer cannot carry the parameters back."""
    if not params or not params.get("do_remote_decode"):
        return
    if stream:
        raise bad_request(
            "kv_transfer_params.do_remote_decode returns the decode replica's parameters in the response body; "
            "send it with stream=false"
        )
    if num_prompts != 1:
        raise bad_request(f"kv_transfer_params hold one prompt's blocks; send one prompt, not {num_prompts}")


def answer_params(params: dict[str, Any] | None, raw: Request) -> dict[str, Any] | None:
    """The parameters for the response, with ``remote_host`` set when the engine left it to this layer."""
    if params is None or params.get("remote_host") is not None:
        return params
    server = raw.scope.get("server")
    host = server[0] if server else raw.url.hostname
    return {**params, "remote_host": host}
