"""An OTLP/HTTP trace receiver for tests and benches: a stdlib HTTP server on a
free loopback port that takes POST /v1/traces (protobuf, as the SDK's
exporter sends it), decodes each request and keeps its spans."""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def attributes(key_values) -> dict[str, Any]:
    """A protobuf KeyValue list as a dict of plain values."""
    out = {}
    for kv in key_values:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


@dataclass
class Span:
    service: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 3 CLIENT, 4 PRODUCER, 5 CONSUMER
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]  # (trace id, span id, attributes)
    status_code: int


@dataclass
class OtlpReceiver:
    requests: int = 0
    spans: list[Span] = field(default_factory=list)
    bytes_received: int = 0
    keep: bool = True  # False: count and decode, keep nothing (a bench's sink)

    def __post_init__(self):
        receiver = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    raw = gzip.decompress(raw)
                elif encoding == "deflate":
                    raw = zlib.decompress(raw)
                status = 404
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(raw)
                    receiver._take(request, len(raw))
                    status = 200
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _take(self, request: ExportTraceServiceRequest, size: int) -> None:
        found = []
        if self.keep:
            for resource_spans in request.resource_spans:
                service = attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        found.append(
                            Span(
                                service,
                                s.name,
                                s.kind,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                attributes(s.attributes),
                                [(k.trace_id.hex(), k.span_id.hex(), attributes(k.attributes)) for k in s.links],
                                s.status.code,
                            )
                        )
        with self._lock:
            self.requests += 1
            self.bytes_received += size
            self.spans.extend(found)

    def of(self, service: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.service == service]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
