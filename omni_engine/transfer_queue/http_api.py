"""The HTTP API: slime's rollout-buffer routes, same request and response shapes.

A bare ASGI app (run by uvicorn with httptools): every request is a few
dictionary lookups and one JSON encode, where a framework would add a
validation and routing layer per request. Stored trajectories are spliced into
responses as the bytes they are (JSON in, JSON out), not decoded and
re-encoded.

Beyond slime's routes: ``/get_rollout_data`` also takes ``max_groups`` and
``timeout_ms`` (wait for a group, instead of polling with sleeps); a full buffer
answers 503 with ``Retry-After``; bad input answers 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

import msgspec

from omni_engine.transfer_queue.buffer import Group
from omni_engine.transfer_queue.data_model import (
    BufferConfig,
    InvalidTrajectory,
    PayloadFormat,
    meta_info,
    parse_trajectory,
    payload_as,
)
from omni_engine.transfer_queue.metrics import metrics_registry, render
from omni_engine.transfer_queue.security import OPEN_PATHS, authorized
from omni_engine.transfer_queue.service import ServiceUnavailable, TransferQueueService

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 30  # slime's buffer allows 1 GiB
_JSON = [(b"content-type", b"application/json")]
_WRITE_OK = b'{"success":true,"message":"Data has been successfully written to buffer","data":{"data":['
_WRITE_TAIL = b'],"meta_info":"write to buffer"}}'
_NO_DATA = b'{"success":false,"message":"No data available to read","data":{"data":[],"meta_info":{}}}'
_encode = msgspec.json.Encoder().encode
_READ_FIELDS = {"max_groups", "timeout_ms"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []


def _error_body(message: str) -> bytes:
    return _encode({"success": False, "message": message, "detail": message})


class TransferQueueHttpApp:
    """ASGI application over a ``TransferQueueService``."""

    def __init__(self, service: TransferQueueService, api_key: str | None = None,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.service = service
        # With a key, every route but ``open_paths`` needs it (``security.py``).
        self._api_key = api_key
        self._open_paths = open_paths
        self.registry = metrics_registry(service)
        # Every handler takes (body, receive): a waiting read listens for the client hanging up.
        self._routes = {
            ("POST", "/buffer/write"): self.write,
            ("POST", "/get_rollout_data"): self.get_rollout_data,
            ("POST", "/config"): self.set_config,
            ("GET", "/config"): self.get_config,
            ("POST", "/buffer/reset"): self.reset,
            ("GET", "/status"): self.status,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics,
        }

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = _JSON
        try:
            self._check_key(scope)
            body = await _read_body(receive)
            status, payload, headers = await self._dispatch(scope["method"], scope["path"], body, receive)
        except HttpError as exc:
            status, payload, headers = exc.status, _error_body(str(exc)), _JSON + exc.headers
        except ServiceUnavailable as exc:
            status, payload = 503, _error_body(str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 with its message, and is logged
            logger.exception("transfer queue: %s %s failed", scope["method"], scope["path"])
            status, payload = 500, _error_body(f"{type(exc).__name__}: {exc}")
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    def _check_key(self, scope: dict) -> None:
        """401 before the body is read, unless the request carries the key or the route is open."""
        if self._api_key is None or scope["path"] in self._open_paths:
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if not authorized(header, self._api_key):
            raise HttpError(401, f"{scope['method']} {scope['path']}: unauthorized: this queue needs "
                                 "'Authorization: Bearer <api key>'", [(b"www-authenticate", b"Bearer")])

    async def _dispatch(self, method: str, path: str, body: bytes, receive: Any) -> tuple[int, bytes, list]:
        handler = self._routes.get((method, path))
        if handler is not None:
            return await handler(body, receive)
        if path.startswith("/buffer/instance/") and len(path) > len("/buffer/instance/"):
            if method != "DELETE":
                raise HttpError(405, f"{method} {path}: only DELETE is allowed here")
            return await self.delete_instance(path[len("/buffer/instance/"):])
        if any(p == path for _, p in self._routes):
            raise HttpError(405, f"{method} {path}: method not allowed")
        raise HttpError(404, f"{method} {path}: no such route")

    # ----------------------------------------------------------------- data
    async def write(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        """One trajectory (slime's ``send_data_to_buffer``), or a JSON array of them."""
        stripped = body.lstrip()
        if stripped[:1] == b"[":
            try:
                items = [parse_trajectory(_encode(obj), PayloadFormat.JSON) for obj in json.loads(body)]
            except (ValueError, InvalidTrajectory) as exc:
                raise HttpError(400, f"/buffer/write: {exc}") from None
        else:
            try:
                items = [parse_trajectory(bytes(body), PayloadFormat.JSON)]
            except InvalidTrajectory as exc:
                raise HttpError(400, f"/buffer/write: {exc}") from None
        result = await self.service.write(items)
        if result.refused:
            retry = str(max(1, math.ceil(result.retry_after_s or 1))).encode()
            raise HttpError(503, f"/buffer/write: {result.refused} of {len(items)} trajectories refused: "
                                 f"{result.error}", [(b"retry-after", retry)])
        if result.duplicates and not result.written and len(items) == 1:
            message = f"Duplicate uid {items[0].uid!r} ignored (already written)"
            return 200, _encode({"success": True, "message": message,
                                 "data": {"data": [], "meta_info": "duplicate uid"}}), _JSON
        return 200, _WRITE_OK + b",".join(t.payload for t in items if t.payload is not None) + _WRITE_TAIL, _JSON

    async def get_rollout_data(self, body: bytes, receive: Any) -> tuple[int, bytes, list]:
        args = _json_object(body, "/get_rollout_data")
        unknown = sorted(set(args) - _READ_FIELDS)
        if unknown:
            raise HttpError(400, f"/get_rollout_data: unknown field(s) {unknown}; accepted: {sorted(_READ_FIELDS)}")
        max_groups = args.get("max_groups")
        if max_groups is not None and (not isinstance(max_groups, int) or max_groups < 1):
            raise HttpError(400, f"/get_rollout_data: max_groups must be a positive integer (got {max_groups!r})")
        timeout_ms = args.get("timeout_ms")
        if timeout_ms is not None and (not isinstance(timeout_ms, (int, float)) or timeout_ms < 0):
            raise HttpError(400, f"/get_rollout_data: timeout_ms must be a number >= 0 (got {timeout_ms!r})")
        if timeout_ms:
            groups = await self._read_unless_disconnected(max_groups, timeout_ms / 1e3, receive)
        else:
            groups = await self.service.read(max_groups)
        if not groups:
            return 200, _NO_DATA, _JSON
        return 200, read_response(groups), _JSON

    async def _read_unless_disconnected(self, max_groups: int | None, timeout: float, receive: Any) -> list:
        """A waiting read whose client hangs up takes nothing (its groups would be lost with the
        response: HTTP has no acknowledgement)."""
        take = asyncio.ensure_future(self.service.take(max_groups, timeout))
        hangup = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait([take, hangup], return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
        if not take.done():
            take.cancel()
            await asyncio.gather(take, return_exceptions=True)
            return []
        delivery = take.result()
        if delivery is None:
            return []
        if hangup.done() and not hangup.cancelled():
            self.service.release(delivery.delivery_id)
            return []
        return await self.service.ack(delivery.delivery_id)

    # ---------------------------------------------------------------- admin
    async def set_config(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        """Change the fields given; the others keep their values."""
        args = _json_object(body, "/config")
        merged = {**msgspec.structs.asdict(self.service.buffer.config), **args}
        try:
            config = msgspec.convert(merged, BufferConfig)
        except msgspec.ValidationError as exc:
            raise HttpError(400, f"/config: {exc}") from None
        try:
            await self.service.configure(config)
        except ValueError as exc:
            raise HttpError(400, f"/config: {exc}") from None
        return 200, _encode({"success": True, "message": "Configuration updated", "data": config}), _JSON

    async def get_config(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        return 200, _encode({"success": True, "message": "", "data": self.service.buffer.config}), _JSON

    async def delete_instance(self, instance_id: str) -> tuple[int, bytes, list]:
        groups, trajectories = await self.service.delete_instance(instance_id)
        return 200, _encode({"success": True,
                             "message": f"Deleted {groups} groups ({trajectories} trajectories) of {instance_id!r}",
                             "data": {"groups": groups, "trajectories": trajectories}}), _JSON

    async def reset(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        await self.service.reset()
        return 200, _encode({"success": True, "message": "Buffer reset"}), _JSON

    async def status(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        return 200, _encode(self.service.status()), _JSON

    async def health(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        if self.service.healthy:
            return 200, b'{"status":"ok"}', _JSON
        return 503, b'{"status":"unavailable"}', _JSON

    async def metrics(self, body: bytes, _receive: Any) -> tuple[int, bytes, list]:
        return 200, render(self.registry), [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


def read_response(groups: list[Group]) -> bytes:
    """slime's read response: every trajectory of the groups, flat, and their meta_info."""
    items = [payload_as(t.payload, t.fmt, PayloadFormat.JSON) for g in groups for t in g.items]
    meta = meta_info([(g.instance_id, g.items) for g in groups])
    meta_json = _encode({"total_samples": meta.total_samples, "num_groups": meta.num_groups,
                         "avg_group_size": meta.avg_group_size, "avg_reward": meta.avg_reward,
                         "finished_groups": meta.finished_group_ids})
    return (b'{"success":true,"message":"Successfully read %d items","data":{"data":[' % len(items)
            + b",".join(items) + b'],"meta_info":' + meta_json + b"}}")


def _json_object(body: bytes, where: str) -> dict:
    if not body.strip():
        return {}
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise HttpError(400, f"{where}: body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise HttpError(400, f"{where}: body must be a JSON object (got {type(obj).__name__})")
    return obj


async def _read_body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HttpError(400, "client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HttpError(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
