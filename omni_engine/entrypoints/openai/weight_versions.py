"""Served completions say which weights made them: ``weight_version`` and ``X-Weight-Version``.

vLLM's serving code builds responses from ``RequestOutput``s and has no field for
the weight version. The pipeline's final outputs carry their stages' versions
(``OmniRequestOutput.stage_versions``); ``MultiStageEngineClient.generate`` puts
them into the holder this middleware opened for the HTTP request
(``RESPONSE_VERSIONS``, a ``ContextVar``: the route runs in the middleware's
context, and a streaming body in a copy of it that shares the holder). The middleware then adds:

* non-streaming: ``"weight_version"`` and ``"weight_versions"`` (stage id -> every
  version, in order) to the JSON body, and the ``X-Weight-Version`` header;
* streaming: ``"weight_version"`` to each ``data:`` event, as the versions stood
  when it was sent (the header goes out before any token exists, so it has none).

``weight_version`` is the version that made the last tokens; several stages on
different versions read ``"s0:v1,s2:v2"``.
"""

from __future__ import annotations

import json
from contextvars import ContextVar

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_engine.entrypoints.openai.routing import add_middleware_first

HEADER = b"x-weight-version"
# Every route vLLM serves from its chat and completion handlers (vLLM 0.32): the SageMaker route
# dispatches to them by the body's shape, the batch and Anthropic handlers are the chat handler's.
VERSIONED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                             "/invocations", "/v1/messages"})

# Inside an HTTP request of VERSIONED_PATHS: the versions of the outputs it received (the engine
# client updates it with each output's ``stage_versions``); None elsewhere.
RESPONSE_VERSIONS: ContextVar[dict[int, list[str]] | None] = ContextVar("omni_response_versions", default=None)


def version_label(stage_versions: dict[int, list[str]]) -> str | None:
    last = {sid: versions[-1] for sid, versions in stage_versions.items() if versions}
    if not last:
        return None
    if len(set(last.values())) == 1:
        return next(iter(last.values()))
    return ",".join(f"s{sid}:{v}" for sid, v in sorted(last.items()))


class WeightVersionMiddleware:
    """Adds the weight version to completion responses (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in VERSIONED_PATHS:
            await self.app(scope, receive, send)
            return
        holder: dict[int, list[str]] = {}
        token = RESPONSE_VERSIONS.set(holder)
        try:
            await self.app(scope, receive, _VersionedSend(send, holder))
        finally:
            RESPONSE_VERSIONS.reset(token)


class _VersionedSend:
    """Rewrites the response as it is sent: a JSON body whole, an event stream event by event."""

    def __init__(self, send: Send, holder: dict[int, list[str]]) -> None:
        self._send = send
        self._holder = holder
        self._start: Message | None = None
        self._json = False
        self._body: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self._json = content_type.startswith(b"application/json")
            if self._json:
                self._start = message  # sent with the body, once the version is known
                return
            await self._send(message)
        elif kind == "http.response.body" and self._json:
            self._body.append(message.get("body", b""))
            if not message.get("more_body", False):
                await self._send_json()
        elif kind == "http.response.body":
            await self._send(self._tag_events(message))
        else:
            await self._send(message)

    async def _send_json(self) -> None:
        assert self._start is not None
        body = b"".join(self._body)
        headers = [(k, v) for k, v in self._start.get("headers", []) if k != b"content-length"]
        label = version_label(self._holder)
        if label is not None:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
            if isinstance(payload, dict) and "error" not in payload:
                payload["weight_version"] = label
                payload["weight_versions"] = {str(s): v for s, v in sorted(self._holder.items())}
                body = json.dumps(payload, separators=(",", ":")).encode()
                headers.append((HEADER, label.encode()))
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _tag_events(self, message: Message) -> Message:
        label = version_label(self._holder)
        body = message.get("body", b"")
        if label is None or b'data: {"' not in body:
            return message
        # A byte-level insert, no parse: each event's object gains the field first.
        field = b'data: {"weight_version":' + json.dumps(label).encode() + b',"'
        return {**message, "body": body.replace(b'data: {"', field)}


def add_weight_versions(app: Starlette) -> Starlette:
    """Install ``WeightVersionMiddleware`` on the app vLLM built."""
    return add_middleware_first(app, WeightVersionMiddleware)
