"""Where spans go: the OpenTelemetry SDK with its OTLP exporter (the ``otel`` extra).

The endpoint and the protocol mean what they mean to vLLM (``--otlp-traces-endpoint``,
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` by default, or ``http/protobuf``), so one
collector set up for vLLM receives both vLLM's spans and ours. Spans leave in batches from
the SDK's own thread, never on the request path.
"""

from __future__ import annotations

import os
from typing import Any

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
SERVICE_NAME = "omni-engine"


class TracingUnavailableError(RuntimeError):
    """Tracing was asked for, and the OpenTelemetry SDK (or the configured protocol) is not there."""


def make_tracer_provider(endpoint: str, *, service_name: str = SERVICE_NAME) -> Any:
    """A ``TracerProvider`` that exports to ``endpoint``; its own, not the process's global one
    (a program that set up OpenTelemetry for itself keeps its provider)."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol not in PROTOCOLS:
        raise TracingUnavailableError(f"{PROTOCOL_ENV}={protocol!r}: the OTLP trace exporter speaks {PROTOCOLS}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
    except ImportError as exc:
        raise TracingUnavailableError(
            f"tracing to {endpoint!r} needs the OpenTelemetry SDK and its OTLP {protocol} exporter "
            f"(pip install 'omni_engine[otel]'): {exc}") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                        "process.pid": os.getpid()}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
