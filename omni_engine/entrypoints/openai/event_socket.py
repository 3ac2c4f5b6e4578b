"""One event session on a WebSocket: what ``/v1/realtime`` and ``/v1/audio/speech/stream`` share.

``serve_session`` accepts the connection, checks ``?model=``, sends the session's events from one
writer task (events from a session's concurrent tasks keep their order and never interleave),
feeds it what the client sends until it disconnects, then closes the session, which aborts what it
has in flight. A route brings the session object; this module knows only its three methods
(``created``, ``handle``, ``close``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect

from omni_engine.entrypoints.openai.served_pipeline import engine_client, unserved_model


class EventWriter:
    """The one writer of a connection: events queue up and go out in order from one task."""

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._write())
        self.closed = False

    def send(self, body: dict[str, Any]) -> None:
        if not self.closed:
            self._queue.put_nowait(body)

    async def _write(self) -> None:
        while (body := await self._queue.get()) is not None:
            try:
                await self._ws.send_text(json.dumps(body))
            except Exception:  # noqa: BLE001 - the peer is gone; the reader sees the disconnect
                self.closed = True
                return

    async def close(self) -> None:
        self._queue.put_nowait(None)
        self.closed = True
        await asyncio.gather(self._task, return_exceptions=True)


def refusal_event(code: str, param: str | None, message: str) -> dict[str, Any]:
    """An ``error`` event sent before the connection is closed (no session exists yet)."""
    return {"type": "error", "event_id": None,
            "error": {"type": "invalid_request_error", "code": code, "param": param, "message": message,
                      "event_id": None}}


async def serve_session(websocket: WebSocket, make_session: Callable[[Callable[[dict[str, Any]], None]], Any],
                        refused: dict[str, Any] | None = None) -> None:
    """Run one event session on ``websocket`` until it closes, then close the session (it aborts what it
    has in flight). A ``?model=`` this server does not serve, or ``refused``, is sent as an error event
    and the socket closed (1008) instead. ``make_session(send)`` builds the session around the writer."""
    model = websocket.query_params.get("model")
    names = unserved_model(engine_client(websocket), model)
    await websocket.accept()
    writer = EventWriter(websocket)
    if names is not None:
        refused = refusal_event("model_not_found", "model",
                                f"The model `{model}` does not exist; this server serves {names}.")
    if refused is not None:
        writer.send(refused)
        await writer.close()
        await websocket.close(code=1008)
        return
    session = make_session(writer.send)
    writer.send(session.created())
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            await session.handle(message.get("text") if message.get("text") is not None else message.get("bytes"))
    except WebSocketDisconnect:
        pass
    finally:
        await session.close()
        await writer.close()
