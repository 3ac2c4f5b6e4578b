"""Tracing a request across the stages of a pipeline (OpenTelemetry).

Stage processes only record timestamps (``stage_timing``, no OpenTelemetry there);
the client turns them into spans (``request_trace``) and exports them
(``exporter``, the OpenTelemetry SDK's OTLP exporter). Off unless an OTLP
endpoint is configured, and then nothing here is even imported on the request path.
"""
