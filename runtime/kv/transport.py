"""The built-in KV transport between a prefill (producer) and a decode (consumer) replica: TCP frames.

What it is: :class:`TransferServer`, a small threaded TCP server in the producer
(``socketserver``; one thread per connection, daemon threads) that answers one message per
connection, and :func:`request_blocks`, the consumer's client for it. A message is a JSON header
(``{"op": "pull", "transfer_id": ..., "engine_id": ..., "positions": [...]}``); the answer is a
JSON header (``{"ok": true, "count": n}`` or ``{"ok": false, "error": ...}``) followed by ``n``
blocks, each in the checked wire form of ``transfer.pack_block`` (address, digest, payload), so
the consumer rejects a block that was corrupted or is not the one its own hash chain names.
Every frame is length-prefixed; the client's whole exchange runs under one deadline, so a
producer that stalls (or a link that drops packets) costs the consumer at most that long.

What it is not: what is held or pulled and when (``remote_prefill.py``), or torch: the server
calls a handler that returns the packed blocks.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"PLKT"
_LEN = struct.Struct(">I")  # JSON headers
_BLOB = struct.Struct(">Q")  # packed blocks
MAX_HEADER = 1 << 20

# handler(message) -> (answer header, packed blocks to send after it); the server calls the blocks'
# ``close()``, if they have one, once the answer is sent or has failed.
Handler = Callable[[dict[str, Any]], tuple[dict[str, Any], Iterable[bytes]]]


class TransferError(Exception):
    """A pull that did not complete; ``reason`` is a metric label (connect, timeout, refused, protocol)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(MAGIC + _LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def _recv_header(sock: socket.socket, deadline: float | None) -> dict[str, Any]:
    head = _recv_exact(sock, len(MAGIC) + _LEN.size, deadline)
    if bytes(head[:4]) != MAGIC:
        raise ValueError(f"not a plimsoll KV transfer frame (magic {bytes(head[:4])!r})")
    (length,) = _LEN.unpack_from(head, 4)
    if length > MAX_HEADER:
        raise ValueError(f"a header of {length} bytes (at most {MAX_HEADER})")
    value = json.loads(bytes(_recv_exact(sock, length, deadline)))
    if not isinstance(value, dict):
        raise ValueError("a header that is not a JSON object")
    return value


class _Connection(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: TransferServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            message = _recv_header(sock, time.monotonic() + server.read_timeout_s)
        except (OSError, ValueError, TimeoutError) as exc:
            log.debug("KV transfer: a bad or late message from %s: %r", self.client_address, exc)
            return
        try:
            header, blobs = server.handler(message)
        except Exception as exc:  # the handler's bug answers one pull, never the server
            log.exception("KV transfer handler failed")
            header, blobs = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
        try:
            _send_header(sock, header)
            for blob in blobs:
                sock.sendall(_BLOB.pack(len(blob)))
                sock.sendall(blob)
        except OSError as exc:  # the consumer gave up (its timeout) or went away
            log.info("KV transfer to %s broke off: %r", self.client_address, exc)
        finally:
            close = getattr(blobs, "close", None)
            if close is not None:
                close()  # what was sent, or was to be, is let go whatever happened


class TransferServer(socketserver.ThreadingTCPServer):
    """The producer's listener on ``host:port`` (0: a free port); ``on_tick`` runs on its thread every poll."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, host: str, port: int, handler: Handler, on_tick: Callable[[], None] | None = None,
        read_timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.handler = handler
        self.on_tick = on_tick
        self.read_timeout_s = read_timeout_s
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Connection)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def service_actions(self) -> None:
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:
                log.exception("KV transfer server tick failed")

    def start(self, poll_interval_s: float = 0.25) -> TransferServer:
        self._thread = threading.Thread(
            target=self.serve_forever, args=(poll_interval_s,), name="kv-transfer-server", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self.server_close()


def request_blocks(
    host: str, port: int, message: dict[str, Any], timeout_s: float
) -> tuple[dict[str, Any], list[bytes]]:
    """Send ``message`` to a producer and return its header and packed blocks, within ``timeout_s`` overall.

    Raises :class:`TransferError`: ``connect`` (nobody listens), ``timeout`` (the deadline passed),
    ``refused`` (the producer answered ``ok: false``, e.g. the blocks expired), ``protocol``.
    """
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError as exc:
        raise TransferError("timeout", f"connect to {host}:{port} timed out after {timeout_s:g}s") from exc
    except OSError as exc:
        raise TransferError("connect", f"cannot connect to {host}:{port}: {exc}") from exc
    try:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_header(sock, message)
            header = _recv_header(sock, deadline)
            if not header.get("ok"):
                raise TransferError(
                    "refused", f"{host}:{port} refused the pull: {header.get('error', 'no reason')}"
                )
            count = int(header.get("count", 0))
            blobs = []
            for _ in range(count):
                (n,) = _BLOB.unpack(bytes(_recv_exact(sock, _BLOB.size, deadline)))
                blobs.append(bytes(_recv_exact(sock, n, deadline)))
            return header, blobs
    except TransferError:
        raise
    except TimeoutError as exc:  # socket.timeout is TimeoutError
        raise TransferError(
            "timeout", f"the pull from {host}:{port} passed its {timeout_s:g}s deadline"
        ) from exc
    except (OSError, ValueError) as exc:
        raise TransferError("protocol", f"the pull from {host}:{port} failed: {exc!r}") from exc
