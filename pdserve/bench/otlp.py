"""An OTLP/HTTP trace receiver on loopback, for benchmarks and tests of pdserve's tracing: it
decodes every export with OpenTelemetry's own protobuf messages and keeps each span (its
service, ids, parent, kind, status and attributes) as a plain dict."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class SpanReceiver:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts

        self.spans: list[dict[str, Any]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ts.ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in request.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            spans.extend(_span(s, attrs.get("service.name", "")) for s in ss.spans)
                reply = ts.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _span(s: Any, service: str) -> dict[str, Any]:
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return getattr(v, kind) if kind else None

    return {
        "name": s.name,
        "service": service,
        "trace_id": s.trace_id.hex(),
        "span_id": s.span_id.hex(),
        "parent": s.parent_span_id.hex(),
        "kind": s.kind,
        "status": s.status.code,
        "attributes": {a.key: value(a.value) for a in s.attributes},
    }
