"""An OTLP/HTTP trace receiver for tests and benchmarks: a stdlib HTTP server
on a free loopback port, in a thread, that takes POST /v1/traces (protobuf,
as the SDK's exporter sends it), decodes each request and keeps its spans
(keep=False: counts them only, a benchmark's sink). Needs opentelemetry-proto
(the otel extra)."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue


def attributes(key_values: Iterable[KeyValue]) -> dict[str, Any]:
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
    status_code: int  # 2: ERROR


@dataclass
class OtlpReceiver:
    keep: bool = True
    requests: int = 0
    span_count: int = 0
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
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
                    receiver._take(request)
                    status = 200
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        count = 0
        found = []
        for resource_spans in request.resource_spans:
            service = attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                count += len(scope_spans.spans)
                if not self.keep:
                    continue
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
            self.span_count += count
            self.spans.extend(found)

    def of(self, service: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.service == service]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SinkProcess:
    """An OtlpReceiver(keep=False) in a process of its own, for benchmarks:
    decoding the requests in the benchmark's process would take its GIL from
    what it measures. close() returns the number of spans received."""

    def __init__(self) -> None:
        # From the checkout's root, where `-m` finds harness/ (it is not installed).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.otlp"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.endpoint = self.proc.stdout.readline().strip()
        if not self.endpoint:
            raise RuntimeError(f"the OTLP sink exited with {self.proc.wait()}")

    def close(self) -> int:
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.proc.stdin.close()  # the sink's signal to report and exit
        count = self.proc.stdout.readline().strip()
        self.proc.wait(10)
        return int(count or 0)


def main() -> None:
    """The sink of SinkProcess: prints its endpoint, then, once stdin closes, its span count."""
    receiver = OtlpReceiver(keep=False)
    print(receiver.endpoint, flush=True)
    sys.stdin.read()
    receiver.close()
    print(receiver.span_count, flush=True)


if __name__ == "__main__":
    main()
