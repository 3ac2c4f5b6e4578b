"""A gateway in front of a real server, for the actor-learner tests: it logs every request's window
at the server's door, can refuse completion batches above a size (as an overloaded server does), and
can hold completions back (a slow rollout)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.serve_helpers import free_port

PASSED_HEADERS = ("content-type", "x-weight-version")


@dataclass
class Window:
    path: str
    start: float
    end: float
    status: int
    prompts: list[str] = field(default_factory=list)


class Gateway:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.max_batch: int | None = None  # completion batches above this get a 503
        self.delay_s = 0.0  # completions are held this long before going upstream
        self.windows: list[Window] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     loop="asyncio"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "Gateway":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def reset(self, max_batch: int | None = None, delay_s: float = 0.0) -> None:
        self.max_batch, self.delay_s, self.windows = max_batch, delay_s, []

    async def _handle(self, request: Request) -> Response:
        start = time.time()
        body = await request.body()
        path = request.url.path
        prompts: list[str] = []
        if path == "/v1/completions":
            prompt = json.loads(body)["prompt"]
            prompts = prompt if isinstance(prompt, list) else [prompt]
            if self.max_batch is not None and len(prompts) > self.max_batch:
                self.windows.append(Window(path, start, time.time(), 503, prompts))
                return Response(f"gateway: batches above {self.max_batch} prompts are refused", status_code=503)
            await asyncio.sleep(self.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with httpx.AsyncClient(timeout=300) as client:
            upstream = await client.request(request.method, f"{self.upstream}{path}", params=request.query_params,
                                            content=body, headers=headers)
        self.windows.append(Window(path, start, time.time(), upstream.status_code, prompts))
        return Response(upstream.content, status_code=upstream.status_code,
                        headers={k: v for k, v in upstream.headers.items() if k.lower() in PASSED_HEADERS})



def sync_windows(windows: list[Window]) -> list[tuple[float, float]]:
    """Each fenced push as the server saw it: from its /pause to its /resume."""
    spans, start = [], None
    for w in sorted(windows, key=lambda w: w.start):
        if w.path == "/pause":
            start = w.start
        elif w.path == "/resume" and start is not None:
            spans.append((start, w.end))
            start = None
    return spans
