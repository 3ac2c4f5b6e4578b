"""The RPC server: a ROUTER socket on the service's event loop.

Requests are read by a ``LoopSocket`` (every waiting message per loop turn)
and each becomes a task; replies are sent with ``NOBLOCK`` on the same socket.
``ROUTER_MANDATORY`` makes a reply to a client that has gone raise instead of
vanishing: groups handed to such a reader go back to the queue at once (they
would after the ack timeout anyway: see ``rpc_protocol``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq

from omni_engine.stage_engine.security import CurveKeys
from omni_engine.stage_engine.loop_socket import LoopSocket
from omni_engine.transfer_queue.data_model import (
    InvalidTrajectory,
    PayloadFormat,
    StoredTrajectory,
    parse_msgpack_batch,
    payload_as,
)
from omni_engine.transfer_queue.rpc_protocol import (
    REQUEST_DECODERS,
    RPC_TYPES,
    GroupHeader,
    GroupsHeader,
    RpcErrorType,
    RpcResult,
    RpcType,
    encode,
    pack_batch,
)
from omni_engine.transfer_queue.security import secure_rpc_server
from omni_engine.transfer_queue.service import Delivery, DeliveryExpired, ServiceUnavailable, TransferQueueService

logger = logging.getLogger(__name__)


class _Subscription:
    def __init__(self, identity: bytes, call_id: int, credit: int) -> None:
        self.identity = identity
        self.call_id = call_id
        self.credit = credit
        self.has_credit = asyncio.Event()
        if credit > 0:
            self.has_credit.set()
        self.task: asyncio.Task | None = None

    def grant(self, groups: int) -> None:
        self.credit += groups
        if self.credit > 0:
            self.has_credit.set()


class TransferQueueRpcServer:
    def __init__(self, service: TransferQueueService, address: str, curve: CurveKeys | None = None) -> None:
        self.service = service
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # CURVE: only admitted client keys complete the handshake (nothing else is read or sent).
        self._auth = secure_rpc_server(self._ctx, self._sock, curve) if curve is not None else None
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # a reply is never dropped or blocked on; readers bound it
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._reader: LoopSocket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._subscriptions: dict[tuple[bytes, int], _Subscription] = {}

    def start(self) -> None:
        self._reader = LoopSocket(asyncio.get_running_loop(), self._sock, self._on_frames, self._on_reader_failed)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # --------------------------------------------------------------- input
    def _on_reader_failed(self, exc: BaseException) -> None:
        logger.error("transfer queue rpc: reading requests failed; the RPC API is down", exc_info=exc)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            rtype = RPC_TYPES[frames[1].bytes]
            header = REQUEST_DECODERS[rtype].decode(frames[2].buffer)
        except (ValueError, KeyError, IndexError, msgspec.DecodeError) as exc:
            logger.warning("transfer queue rpc: malformed request from %s dropped: %s", identity.hex(), exc)
            call_id = _guess_call_id(frames)
            if call_id is not None:
                self._reply(identity, RpcResult(call_id, False, error=f"malformed request: {exc}",
                                                error_type=RpcErrorType.BAD_REQUEST))
            return
        if rtype is RpcType.CREDIT:
            sub = self._subscriptions.get((identity, header.call_id))
            if sub is not None:
                sub.grant(header.groups)
            return
        if rtype is RpcType.UNSUBSCRIBE:
            sub = self._subscriptions.pop((identity, header.call_id), None)
            if sub is not None and sub.task is not None:
                sub.task.cancel()
            return
        if rtype is RpcType.SUBSCRIBE:
            sub = _Subscription(identity, header.call_id, max(1, header.prefetch_groups))
            self._subscriptions[(identity, header.call_id)] = sub
            sub.task = self._spawn(self._serve_subscription(sub))
            return
        if rtype is RpcType.GET_STATUS:
            self._reply(identity, RpcResult(header.call_id, True, self.service.status()))
            return
        if rtype is RpcType.ACK:
            self._spawn(self._ack(identity, header))
        elif rtype is RpcType.BATCH_WRITE:
            self._batch_write(identity, header.call_id, frames[3:])
        elif rtype is RpcType.BATCH_READ:
            self._spawn(self._batch_read(identity, header))

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------ handlers
    def _batch_write(self, identity: bytes, call_id: int, batch: list[zmq.Frame]) -> None:
        """In the reader's callback, no task: the reply goes from the log's durability callback."""
        try:
            items = _parse_batch(batch)
        except InvalidTrajectory as exc:
            self._reply(identity, RpcResult(call_id, False, error=f"BatchWrite: {exc}",
                                            error_type=RpcErrorType.INVALID_TRAJECTORY))
            return
        try:
            result, durable = self.service.write_nowait(items)
        except ServiceUnavailable as exc:
            self._reply(identity, RpcResult(call_id, False, error=str(exc), error_type=RpcErrorType.UNAVAILABLE))
            return
        if result.refused:
            answer = RpcResult(call_id, False, result, error=f"BatchWrite: {result.error}",
                               error_type=RpcErrorType.BUFFER_FULL, retry_after_s=result.retry_after_s)
        else:
            answer = RpcResult(call_id, True, result)
        if durable is None:
            self._reply(identity, answer)
            return

        def on_durable(future: asyncio.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                error = "cancelled" if future.cancelled() else str(future.exception())
                self._reply(identity, RpcResult(call_id, False, error=f"BatchWrite: not logged: {error}",
                                                error_type=RpcErrorType.UNAVAILABLE))
            else:
                self._reply(identity, answer)

        durable.add_done_callback(on_durable)

    async def _batch_read(self, identity: bytes, req: Any) -> None:
        if req.max_groups is not None and req.max_groups < 1:
            self._reply(identity, RpcResult(req.call_id, False, error=f"BatchRead: max_groups must be >= 1 "
                                            f"(got {req.max_groups})", error_type=RpcErrorType.BAD_REQUEST))
            return
        timeout = None
        if req.block:
            timeout = float("inf") if req.timeout_ms is None else req.timeout_ms / 1e3
        try:
            delivery = await self.service.take(req.max_groups, timeout)
        except ServiceUnavailable as exc:
            self._reply(identity, RpcResult(req.call_id, False, error=str(exc), error_type=RpcErrorType.UNAVAILABLE))
            return
        self._send_groups(identity, req.call_id, delivery)

    async def _ack(self, identity: bytes, req: Any) -> None:
        try:
            await self.service.ack(req.delivery_id)
        except DeliveryExpired as exc:
            self._reply(identity, RpcResult(req.call_id, False, error=str(exc),
                                            error_type=RpcErrorType.DELIVERY_EXPIRED))
        except ServiceUnavailable as exc:
            self._reply(identity, RpcResult(req.call_id, False, error=str(exc), error_type=RpcErrorType.UNAVAILABLE))
        else:
            self._reply(identity, RpcResult(req.call_id, True))

    async def _serve_subscription(self, sub: _Subscription) -> None:
        """Push ready groups while the subscriber has credit; end when it goes."""
        try:
            while True:
                await sub.has_credit.wait()
                delivery = await self.service.take(sub.credit, float("inf"))
                if delivery is None:
                    continue
                sub.credit -= len(delivery.groups)
                if sub.credit <= 0:
                    sub.has_credit.clear()
                if not self._send_groups(sub.identity, sub.call_id, delivery):
                    return
        except ServiceUnavailable:
            return
        finally:
            self._subscriptions.pop((sub.identity, sub.call_id), None)

    # --------------------------------------------------------------- output
    def _send_groups(self, identity: bytes, call_id: int, delivery: Delivery | None) -> bool:
        """Send (nothing ready: an empty GROUPS); a reader that is gone gets nothing handed out.
        False: it is gone."""
        if delivery is None:
            return self._send(identity, [RpcType.GROUPS.value, encode(GroupsHeader(call_id, 0, []))])
        groups = delivery.groups
        header = GroupsHeader(call_id, delivery.delivery_id,
                              [GroupHeader(g.instance_id, g.size, g.complete, len(g.items)) for g in groups])
        batch = pack_batch([payload_as(t.payload, t.fmt, PayloadFormat.MSGPACK) for g in groups for t in g.items])
        if self._send(identity, [RpcType.GROUPS.value, encode(header), batch]):
            return True
        logger.warning("transfer queue rpc: reader %s is gone; its %d groups go back to the queue",
                       identity.hex(), len(groups))
        self.service.release(delivery.delivery_id)
        return False

    def _reply(self, identity: bytes, result: RpcResult) -> None:
        self._send(identity, [RpcType.RESULT.value, encode(result)])

    def _send(self, identity: bytes, frames: list[bytes]) -> bool:
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN, zmq.ENOTSOCK, zmq.ETERM):  # (gone, or closing)
                raise
            return False
        finally:
            if self._reader is not None:
                self._reader.check()  # the send may have taken the edge the reader waits for


def _parse_batch(batch: list[zmq.Frame]) -> list[StoredTrajectory]:
    """The trajectories of a BatchWrite's batch frame."""
    if len(batch) != 1:
        raise InvalidTrajectory(f"expected one batch frame after the header, got {len(batch)} frames")
    return parse_msgpack_batch(batch[0].buffer)


def _guess_call_id(frames: list[zmq.Frame]) -> int | None:
    try:
        value = msgspec.msgpack.decode(frames[2].buffer)
        return value[0] if isinstance(value, list) and value and isinstance(value[0], int) else None
    except (IndexError, msgspec.DecodeError):
        return None
