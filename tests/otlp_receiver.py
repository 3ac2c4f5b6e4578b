"""An OTLP/HTTP trace receiver for tests: what a collector would get, decoded with the
official ``opentelemetry-proto`` types (not with the SDK that sent it)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    events: list[tuple[str, int]]
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def is_error(self) -> bool:
        return self.status_code == Status.STATUS_CODE_ERROR


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """``POST /v1/traces`` (protobuf) on 127.0.0.1; ``spans`` holds every span received."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.start_time_unix_nano,
                        s.end_time_unix_nano, {kv.key: any_value(kv.value) for kv in s.attributes},
                        s.status.code, s.status.message, [(e.name, e.time_unix_nano) for e in s.events], resource))
        with self._lock:
            self.requests += 1
            self.spans.extend(received)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for_new(self, since: int, count: int, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans received after the first ``since`` (of any trace) once there are ``count`` of them:
        a test that then checks their trace sees spans that went into another one at once."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                new = self.spans[since:]
            if len(new) >= count:
                return new
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(new)} of {count} spans came: {[(s.name, s.trace_id) for s in new]}")
            time.sleep(0.05)

    def wait_for(self, trace_id: str, predicate, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once ``predicate(spans)`` holds; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: got {[(s.name, s.parent_span_id) for s in spans]}")
            time.sleep(0.1)


@contextlib.contextmanager
def otlp_over_http() -> Iterator[None]:
    """Exporters made inside send OTLP over HTTP (what ``OtlpReceiver`` speaks), as
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` makes them; the variable is restored after."""
    name = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    before = os.environ.get(name)
    os.environ[name] = "http/protobuf"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
