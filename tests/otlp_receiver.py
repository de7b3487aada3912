"""A small OTLP/HTTP traces receiver for tests and benches: it decodes every export with
``opentelemetry-proto`` (as a collector would) and keeps the spans, flattened.

    with OtlpReceiver() as rx:          # listens on 127.0.0.1:<free port>
        ... tracing.endpoint = rx.endpoint ...
        spans = rx.wait_for(lambda spans: ..., timeout=10)
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    trace_id: str  # hex, as a traceparent spells it
    span_id: str
    parent_id: str  # "" for a root
    name: str
    service: str  # the resource's service.name: which process made it
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    failed: bool  # status code ERROR
    start_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which in ("string_value", "bool_value", "int_value", "double_value") else str(v)


class OtlpReceiver:
    """``keep=False``: count the spans and drop them (a bench's sink)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[Span] = []
        self.count = 0
        self._lock = threading.Lock()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                rx._add(req)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_a: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _add(self, req: ExportTraceServiceRequest) -> None:
        got: list[Span] = []
        n = 0
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                n += len(ss.spans)
                if not self.keep:
                    continue
                for s in ss.spans:
                    got.append(Span(trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                                    name=s.name, service=str(res.get("service.name", "")), kind=s.kind,
                                    failed=s.status.code == 2, start_ns=s.start_time_unix_nano,
                                    attributes={a.key: _value(a.value) for a in s.attributes},
                                    events=[e.name for e in s.events]))
        with self._lock:
            self.spans.extend(got)
            self.count += n

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, done: Callable[[list[Span]], Any], timeout: float, what: str) -> Any:
        """Until ``done(spans so far)`` is truthy (then that value); AssertionError after ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            value = done(spans)
            if value:
                return value
            if time.monotonic() > end:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"{what}: not seen in {timeout}s; {len(spans)} spans received: {names}")
            time.sleep(0.1)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
