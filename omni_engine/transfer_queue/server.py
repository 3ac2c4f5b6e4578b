"""``TransferQueueServer``: the service with its HTTP and RPC APIs, in one process, on one loop.

Started, it prints one line, ``transfer queue ready {json}``, with the bound
addresses (ports given as 0 are chosen by the OS), so whoever started it knows
where to connect. SIGTERM / SIGINT stop it cleanly: the APIs close, then the
log is flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

import uvicorn

from omni_engine.transfer_queue.http_api import TransferQueueHttpApp
from omni_engine.transfer_queue.rpc_server import TransferQueueRpcServer
from omni_engine.transfer_queue.security import QueueSecurity
from omni_engine.transfer_queue.service import TransferQueueService

logger = logging.getLogger(__name__)

READY_PREFIX = "transfer queue ready "


class InsecureBindError(OSError):
    """An API would listen on a non-loopback address without its protection."""


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: this server owns shutdown order."""

    def capture_signals(self):  # noqa: D102
        return contextlib.nullcontext()


class TransferQueueServer:
    def __init__(self, service: TransferQueueService, host: str = "127.0.0.1", port: int = 8889,
                 rpc_address: str | None = "tcp://127.0.0.1:8890", security: QueueSecurity | None = None) -> None:
        self.service = service
        self.security = security or QueueSecurity()
        self.host, self.port = host, port
        self.rpc_address = rpc_address
        self.rpc: TransferQueueRpcServer | None = None
        self._http: _UvicornServer | None = None
        self._http_task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        problems = self.security.exposure_problems(self.host, self.rpc_address)
        if problems and not self.security.insecure:
            raise InsecureBindError("refusing to start: " + "; ".join(problems)
                                    + " (--insecure starts it anyway)")
        for problem in problems:
            logger.warning("transfer queue: INSECURE (--insecure): %s", problem)
        await self.service.start()
        if self.rpc_address is not None:
            self.rpc = TransferQueueRpcServer(self.service, self.rpc_address, self.security.curve)
            self.rpc.start()
        app = TransferQueueHttpApp(self.service, self.security.api_key, self.security.open_paths())
        config = uvicorn.Config(app, host=self.host, port=self.port, loop="none",
                                http="httptools", lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=30, backlog=4096)
        self._http = _UvicornServer(config)
        self._http_task = asyncio.create_task(self._http.serve(), name="transfer-queue-http")
        while not self._http.started:
            if self._http_task.done():
                await self._http_task  # raises what stopped it (a port in use, ...)
                raise RuntimeError(f"transfer queue: HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        self.port = self._http.servers[0].sockets[0].getsockname()[1]

    def ready_line(self) -> str:
        info = {"http": self.http_url, "rpc": self.rpc.address if self.rpc else None,
                "api_key": self.security.api_key is not None, "curve": self.security.curve is not None,
                "recovered_records": self.service.recovered_records,
                "recovery_seconds": round(self.service.recovery_seconds, 3)}
        return READY_PREFIX + json.dumps(info)

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                await asyncio.gather(self._http_task, return_exceptions=True)
        if self.rpc is not None:
            await self.rpc.close()
        await self.service.close()

    async def serve_forever(self) -> None:
        """Start, announce, serve until SIGTERM / SIGINT, stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        print(self.ready_line(), flush=True)
        try:
            await self._stop.wait()
        finally:
            await self.stop()
            logger.info("transfer queue stopped")


def run(server: TransferQueueServer) -> int:
    import uvloop

    try:
        uvloop.run(server.serve_forever())
    except OSError as exc:
        print(f"transfer queue: {exc}", file=sys.stderr)
        return 1
    return 0
