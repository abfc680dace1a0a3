"""A real OTLP/HTTP trace receiver for tests: POST /v1/traces bodies decoded with ``opentelemetry-proto``.

What it is: the collector's own wire format, served by a plain HTTP server on 127.0.0.1;
each span arrives as a dict (service, name, ids, parent, attributes). ``wait_for`` waits
for named spans (a marker, not a sleep). Shared by the serve/route and operator tests.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Receiver:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            attrs = {a.key: _value(a.value) for a in s.attributes}
                            with receiver.lock:
                                receiver.spans.append({
                                    "service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(), "attrs": attrs,
                                })
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(
        self, wanted: set[tuple[str, str]], timeout: float = 60, where: Any = None
    ) -> list[dict[str, Any]]:
        """Wait until every (service, span name) in ``wanted`` has arrived (among spans ``where`` accepts)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                got = {(s["service"], s["name"]) for s in self.spans if where is None or where(s)}
                if wanted <= got:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"spans {wanted - got} never arrived; got {sorted(got)}")


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None
