"""``TransferQueueClient`` (blocking) and ``AsyncTransferQueueClient``: one API, both protocols.

Give ``url`` (HTTP, slime's routes) and/or ``rpc_address`` (ZMQ): writes, reads,
status and subscriptions go over RPC when it is given, else over HTTP; the
admin calls (``configure``, ``delete_instance``, ``reset``) are HTTP's. Errors
raise ``TransferQueueError``; a full buffer raises ``BufferFullError`` with the
server's ``retry_after_s``.

Reads over HTTP return slime's flat list regrouped by consecutive
``instance_id``; over RPC the groups are exact (two groups of one instance in
one read stay two).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq

from omni_engine.stage_engine.security import StageCurveKeys
from omni_engine.stage_engine.loop_socket import LoopSocket
from omni_engine.transfer_queue.data_model import (
    BatchReadResult,
    BufferConfig,
    BufferStatus,
    MetaInfo,
    Trajectory,
    TrajectoryGroup,
)
from omni_engine.transfer_queue.rpc_protocol import (
    GROUPS_DECODER,
    RESULT_DECODER,
    AckRequest,
    BatchReadRequest,
    CallHeader,
    CreditGrant,
    RpcErrorType,
    RpcType,
    SubscribeRequest,
    encode,
)
from omni_engine.transfer_queue.security import api_key_from_env, secure_rpc_client
from omni_engine.transfer_queue.service import WriteResult

logger = logging.getLogger(__name__)

TrajectoryLike = Trajectory | dict[str, Any]
_trajectories_from_msgpack = msgspec.msgpack.Decoder(list[Trajectory]).decode


class TransferQueueError(RuntimeError):
    """The server refused or failed a call; the message says which and why."""


class AckUncertainError(TransferQueueError):
    """A read's acknowledgement got no answer (the server died, or the connection did): ``groups``
    may or may not be consumed. After a restart they are delivered again unless the server had
    logged the acknowledgement; a consumer that must not see a group twice dedups by uid."""

    def __init__(self, message: str, groups: list[TrajectoryGroup]) -> None:
        super().__init__(message)
        self.groups = groups


class BufferFullError(TransferQueueError):
    def __init__(self, message: str, retry_after_s: float | None, result: WriteResult | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.result = result  # what of a batch was written before the buffer filled


# ---------------------------------------------------------------- shared
def _packed(trajectories: list[TrajectoryLike]) -> list[bytes]:
    """The batch frame: one msgpack array of the trajectories (see ``rpc_protocol``)."""
    return [encode(trajectories)]


def _read_frames(frames: list[bytes]) -> tuple[int, list[TrajectoryGroup]]:
    """(delivery id to acknowledge, groups)."""
    header = GROUPS_DECODER.decode(frames[1])
    if not header.groups:
        return header.delivery_id, []
    trajectories = iter(_trajectories_from_msgpack(frames[2]))
    groups = [TrajectoryGroup(instance_id=g.instance_id, group_size=g.group_size, is_complete=g.is_complete,
                              trajectories=[next(trajectories) for _ in range(g.num_trajectories)])
              for g in header.groups]
    return header.delivery_id, groups


def _as_result(groups: list[TrajectoryGroup]) -> BatchReadResult:
    total = sum(len(g.trajectories) for g in groups)
    if not total:
        return BatchReadResult(success=False, message="No data available to read")
    meta = MetaInfo(total_samples=total, num_groups=len(groups), avg_group_size=total / len(groups),
                    avg_reward=sum(t.reward for g in groups for t in g.trajectories) / total,
                    finished_group_ids=[g.instance_id for g in groups])
    return BatchReadResult(success=True, message=f"Successfully read {total} items", groups=groups, meta_info=meta)


def _expire(future: asyncio.Future, message: str) -> None:
    if not future.done():
        future.set_exception(TransferQueueError(message))


def _check(frames: list[bytes], what: str) -> Any:
    result = RESULT_DECODER.decode(frames[1])
    if result.ok:
        return result.value
    message = f"{what}: {result.error}"
    if result.error_type is RpcErrorType.BUFFER_FULL:
        written = msgspec.convert(result.value, WriteResult) if result.value is not None else None
        raise BufferFullError(message, result.retry_after_s, written)
    raise TransferQueueError(message)


def _http_read_result(body: dict) -> BatchReadResult:
    data = body.get("data") or {}
    items = [msgspec.convert(item, Trajectory) for item in data.get("data", [])]
    groups: list[TrajectoryGroup] = []
    for instance_id, run in itertools.groupby(items, key=lambda t: t.instance_id):
        run = list(run)
        groups.append(TrajectoryGroup(instance_id=instance_id, trajectories=run, group_size=len(run),
                                      is_complete=True))
    return _as_result(groups) if body.get("success") else BatchReadResult(success=False,
                                                                         message=body.get("message", ""))


def _http_check(response: Any, what: str) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text}
    if response.status_code == 503 and "retry-after" in response.headers:
        raise BufferFullError(f"{what}: {body.get('message')}", float(response.headers["retry-after"]))
    if response.status_code != 200:
        raise TransferQueueError(f"{what}: HTTP {response.status_code}: {body.get('message', body)}")
    return body


def _read_args(max_groups: int | None, block: bool, timeout: float | None) -> dict:
    args: dict[str, Any] = {}
    if max_groups is not None:
        args["max_groups"] = max_groups
    if block:
        args["timeout_ms"] = int((timeout if timeout is not None else 3600.0) * 1e3)
    return args


class _Endpoints:
    """Where the queue is, and the credentials for it: ``api_key`` for HTTP (default:
    ``$OMNI_ENGINE_TRANSFER_QUEUE_API_KEY``), ``curve`` keys for RPC (``client_curve_keys``)."""

    def __init__(self, url: str | None, rpc_address: str | None, api_key: str | None = None,
                 curve: StageCurveKeys | None = None) -> None:
        if url is None and rpc_address is None:
            raise ValueError("TransferQueueClient: give url (HTTP) and/or rpc_address (ZMQ)")
        self.url = url.rstrip("/") if url else None
        self.rpc_address = rpc_address
        self._ids = itertools.count(1)
        api_key = api_key or api_key_from_env()
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._curve = curve

    def next_id(self) -> int:
        return next(self._ids)

    def no_reply_hint(self) -> str:
        if self._curve is None:
            return " (a queue with CURVE on answers only clients with admitted keys)"
        return " (with CURVE: is this client's key admitted by the server, and its server key right?)"

    def need_url(self, what: str) -> str:
        if self.url is None:
            raise TransferQueueError(f"{what} is an HTTP call: this client has no url")
        return self.url


# ------------------------------------------------------------------ sync
class TransferQueueClient(_Endpoints):
    """Blocking client; not thread-safe (one per thread)."""

    def __init__(self, url: str | None = None, rpc_address: str | None = None, timeout: float = 60.0, *,
                 api_key: str | None = None, curve: StageCurveKeys | None = None) -> None:
        super().__init__(url, rpc_address, api_key, curve)
        self.timeout = timeout
        self._http = None
        # One context (one I/O thread) per process for every client, as pyzmq intends.
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def __enter__(self) -> TransferQueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # transports
    def _post(self, path: str, json: Any = None, method: str = "POST") -> dict:
        import httpx

        if self._http is None:
            self._http = httpx.Client(base_url=self.need_url(path), timeout=self.timeout, headers=self._headers)
        return _http_check(self._http.request(method, path, json=json), path)

    def _dealer(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_rpc_client(sock, self._curve)
        sock.connect(self.rpc_address)
        return sock

    def _call(self, rtype: RpcType, header: Any, payloads: list[bytes] = (), timeout: float | None = None) -> list:
        if self._sock is None:
            self._sock = self._dealer()
        self._sock.send_multipart([rtype.value, encode(header), *payloads], copy=False)
        wait_ms = int((timeout if timeout is not None else self.timeout) * 1e3)
        while True:
            if not self._sock.poll(wait_ms):
                # The reply may still come; a fresh socket keeps it from answering a later call.
                self._sock.close(linger=0)
                self._sock = None
                raise TransferQueueError(f"{rtype.name}: no reply from {self.rpc_address} within {wait_ms} ms"
                                         f"{self.no_reply_hint()}")
            frames = self._sock.recv_multipart()
            call_id = msgspec.msgpack.decode(frames[1])[0]
            if call_id == header.call_id:
                return frames
            logger.warning("transfer queue client: late reply to call %d dropped", call_id)

    # data
    def write(self, trajectory: TrajectoryLike) -> WriteResult:
        return self.batch_write([trajectory])

    def batch_write(self, trajectories: list[TrajectoryLike]) -> WriteResult:
        if self.rpc_address is None:
            items = [msgspec.to_builtins(t) for t in trajectories]
            body = self._post("/buffer/write", items[0] if len(items) == 1 else items)
            written = len(body["data"]["data"])
            return WriteResult(written=written, duplicates=len(trajectories) - written)
        frames = self._call(RpcType.BATCH_WRITE, CallHeader(self.next_id()), _packed(trajectories))
        return msgspec.convert(_check(frames, "BatchWrite"), WriteResult)

    def read(self, max_groups: int | None = None, block: bool = False, timeout: float | None = None
             ) -> BatchReadResult:
        """Consume ready groups; ``block``: wait up to ``timeout`` s (None: indefinitely) for one."""
        if self.rpc_address is None:
            return _http_read_result(self._post("/get_rollout_data", _read_args(max_groups, block, timeout)))
        req = BatchReadRequest(self.next_id(), max_groups, block, None if timeout is None else int(timeout * 1e3))
        wait = None if not block else (1e9 if timeout is None else timeout + self.timeout)
        frames = self._call(RpcType.BATCH_READ, req, timeout=wait)
        if frames[0] == RpcType.RESULT.value:
            _check(frames, "BatchRead")
        delivery_id, groups = _read_frames(frames)
        if groups:  # consumed only once acknowledged: a reader that dies before has them delivered again
            try:
                frames = self._call(RpcType.ACK, AckRequest(self.next_id(), delivery_id))
            except TransferQueueError as exc:
                raise AckUncertainError(f"BatchRead: acknowledging failed: {exc}", groups) from None
            _check(frames, "BatchRead (ack)")
        return _as_result(groups)

    def status(self) -> BufferStatus:
        if self.rpc_address is None:
            return msgspec.convert(self._post("/status", method="GET"), BufferStatus)
        return msgspec.convert(_check(self._call(RpcType.GET_STATUS, CallHeader(self.next_id())), "GetStatus"),
                               BufferStatus)

    def subscribe(self, prefetch_groups: int = 4) -> Iterator[TrajectoryGroup]:
        """Ready groups as they come, at most ``prefetch_groups`` sent ahead of the ones taken."""
        if self.rpc_address is None:
            raise TransferQueueError("subscribe is an RPC call: this client has no rpc_address")
        sock, call_id = self._dealer(), self.next_id()
        pushed: deque[list[bytes]] = deque()  # pushes that came while an ack was awaited

        def recv() -> list[bytes]:
            return pushed.popleft() if pushed else sock.recv_multipart()

        def ack(delivery_id: int) -> None:
            ack_id = self.next_id()
            sock.send_multipart([RpcType.ACK.value, encode(AckRequest(ack_id, delivery_id))])
            while True:
                frames = sock.recv_multipart()
                if frames[0] == RpcType.RESULT.value and msgspec.msgpack.decode(frames[1])[0] == ack_id:
                    _check(frames, "Subscribe (ack)")
                    return
                pushed.append(frames)

        try:
            sock.send_multipart([RpcType.SUBSCRIBE.value, encode(SubscribeRequest(call_id, prefetch_groups))])
            while True:
                frames = recv()
                if frames[0] == RpcType.RESULT.value:
                    _check(frames, "Subscribe")
                    continue
                delivery_id, groups = _read_frames(frames)
                if groups:
                    ack(delivery_id)
                for group in groups:
                    yield group
                    sock.send_multipart([RpcType.CREDIT.value, encode(CreditGrant(call_id, 1))])
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([RpcType.UNSUBSCRIBE.value, encode(CallHeader(call_id))], zmq.NOBLOCK)
            sock.close(linger=100)

    # admin (HTTP)
    def configure(self, **fields: Any) -> BufferConfig:
        return msgspec.convert(self._post("/config", fields)["data"], BufferConfig)

    def delete_instance(self, instance_id: str) -> dict:
        return self._post(f"/buffer/instance/{instance_id}", method="DELETE")["data"]

    def reset(self) -> None:
        self._post("/buffer/reset")


# ----------------------------------------------------------------- async
class AsyncTransferQueueClient(_Endpoints):
    """The same calls as ``TransferQueueClient``, awaitable; many may run at once on one socket."""

    def __init__(self, url: str | None = None, rpc_address: str | None = None, timeout: float = 60.0, *,
                 api_key: str | None = None, curve: StageCurveKeys | None = None) -> None:
        super().__init__(url, rpc_address, api_key, curve)
        self.timeout = timeout
        self._http = None
        # Replies are read by a LoopSocket (every waiting reply in one loop callback) and sends
        # never wait (no send high-water mark: calls in flight are bounded by their callers), so
        # the socket is a plain one, on the process's one shared context.
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._subs: dict[int, asyncio.Queue] = {}
        self._reader: LoopSocket | None = None

    async def __aenter__(self) -> AsyncTransferQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._close_socket(TransferQueueError("the client was closed"))

    def _close_socket(self, error: TransferQueueError) -> None:
        """Close the socket; calls still waiting fail with ``error``."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    async def _post(self, path: str, json: Any = None, method: str = "POST") -> dict:
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.need_url(path), timeout=self.timeout, headers=self._headers)
        return _http_check(await self._http.request(method, path, json=json), path)

    def _send(self, frames: list[bytes]) -> None:
        if self._sock is None:
            sock = self._sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            secure_rpc_client(sock, self._curve)
            sock.connect(self.rpc_address)
            self._reader = LoopSocket(asyncio.get_running_loop(), sock, self._on_reply, self._on_reader_failed,
                                        copy=True)
        self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self._reader.check()  # the send may have taken the edge the reader waits for

    def _on_reply(self, frames: list[bytes]) -> None:
        call_id = msgspec.msgpack.decode(frames[1])[0]
        if (queue := self._subs.get(call_id)) is not None:
            queue.put_nowait(frames)
        elif (future := self._calls.pop(call_id, None)) is not None and not future.done():
            future.set_result(frames)
        else:
            logger.warning("transfer queue client: reply to call %d nobody waits for dropped", call_id)

    def _on_reader_failed(self, exc: BaseException) -> None:
        self._close_socket(TransferQueueError(f"reading replies from {self.rpc_address} failed: {exc}"))
        for queue in self._subs.values():
            queue.put_nowait(exc)

    async def _call(self, rtype: RpcType, header: Any, payloads: list[bytes] = (), timeout: float | None = None
                    ) -> list:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls[header.call_id] = future
        # A timer on the future itself: cheaper than asyncio.wait_for's wrapper and its callbacks.
        timer = loop.call_later(timeout if timeout is not None else self.timeout, _expire, future,
                                f"{rtype.name}: no reply from {self.rpc_address} in time{self.no_reply_hint()}")
        try:
            self._send([rtype.value, encode(header), *payloads])
            return await future
        finally:
            timer.cancel()
            self._calls.pop(header.call_id, None)

    async def write(self, trajectory: TrajectoryLike) -> WriteResult:
        return await self.batch_write([trajectory])

    async def batch_write(self, trajectories: list[TrajectoryLike]) -> WriteResult:
        if self.rpc_address is None:
            items = [msgspec.to_builtins(t) for t in trajectories]
            body = await self._post("/buffer/write", items[0] if len(items) == 1 else items)
            written = len(body["data"]["data"])
            return WriteResult(written=written, duplicates=len(trajectories) - written)
        frames = await self._call(RpcType.BATCH_WRITE, CallHeader(self.next_id()), _packed(trajectories))
        return msgspec.convert(_check(frames, "BatchWrite"), WriteResult)

    async def read(self, max_groups: int | None = None, block: bool = False, timeout: float | None = None
                   ) -> BatchReadResult:
        if self.rpc_address is None:
            return _http_read_result(await self._post("/get_rollout_data", _read_args(max_groups, block, timeout)))
        req = BatchReadRequest(self.next_id(), max_groups, block, None if timeout is None else int(timeout * 1e3))
        wait = None if not block else (1e9 if timeout is None else timeout + self.timeout)
        frames = await self._call(RpcType.BATCH_READ, req, timeout=wait)
        if frames[0] == RpcType.RESULT.value:
            _check(frames, "BatchRead")
        delivery_id, groups = _read_frames(frames)
        if groups:
            try:
                frames = await self._call(RpcType.ACK, AckRequest(self.next_id(), delivery_id))
            except TransferQueueError as exc:
                raise AckUncertainError(f"BatchRead: acknowledging failed: {exc}", groups) from None
            _check(frames, "BatchRead (ack)")
        return _as_result(groups)

    async def status(self) -> BufferStatus:
        if self.rpc_address is None:
            return msgspec.convert(await self._post("/status", method="GET"), BufferStatus)
        frames = await self._call(RpcType.GET_STATUS, CallHeader(self.next_id()))
        return msgspec.convert(_check(frames, "GetStatus"), BufferStatus)

    async def subscribe(self, prefetch_groups: int = 4) -> AsyncIterator[TrajectoryGroup]:
        if self.rpc_address is None:
            raise TransferQueueError("subscribe is an RPC call: this client has no rpc_address")
        call_id = self.next_id()
        queue: asyncio.Queue = asyncio.Queue()
        self._subs[call_id] = queue
        try:
            self._send([RpcType.SUBSCRIBE.value, encode(SubscribeRequest(call_id, prefetch_groups))])
            while True:
                frames = await queue.get()
                if isinstance(frames, BaseException):  # the socket failed
                    raise TransferQueueError(f"Subscribe: reading from {self.rpc_address} failed: {frames}")
                if frames[0] == RpcType.RESULT.value:
                    _check(frames, "Subscribe")
                    continue
                delivery_id, groups = _read_frames(frames)
                if groups:
                    _check(await self._call(RpcType.ACK, AckRequest(self.next_id(), delivery_id)), "Subscribe (ack)")
                for group in groups:
                    yield group
                    self._send([RpcType.CREDIT.value, encode(CreditGrant(call_id, 1))])
        finally:
            self._subs.pop(call_id, None)
            if self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._send([RpcType.UNSUBSCRIBE.value, encode(CallHeader(call_id))])

    async def configure(self, **fields: Any) -> BufferConfig:
        return msgspec.convert((await self._post("/config", fields))["data"], BufferConfig)

    async def delete_instance(self, instance_id: str) -> dict:
        return (await self._post(f"/buffer/instance/{instance_id}", method="DELETE"))["data"]

    async def reset(self) -> None:
        await self._post("/buffer/reset")
