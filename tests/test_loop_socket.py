"""``LoopSocket``: every message read, in order, without pyzmq's asyncio recv.

Real ZMQ sockets over ipc (a PUSH in a thread, the reader on the loop's PULL).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from omni_engine.stage_engine.loop_socket import MAX_MESSAGES_PER_TURN, LoopSocket


@pytest.fixture
def pull_push(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/s")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{tmp_path}/s")
    yield pull, push
    ctx.destroy(linger=0)


async def _collect(reader_args, expect: int, timeout: float = 10.0) -> list[bytes]:
    got: list[bytes] = []
    done = asyncio.Event()

    def on_frames(frames):
        got.append(b"".join(f.bytes for f in frames))
        if len(got) == expect:
            done.set()

    reader = LoopSocket(asyncio.get_running_loop(), *reader_args(on_frames))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        reader.close()
    return got


async def test_reads_every_message_in_order_across_turns(pull_push):
    """More messages than one turn reads, sent before and while the reader runs."""
    pull, push = pull_push
    n = 3 * MAX_MESSAGES_PER_TURN + 7
    for i in range(50):  # waiting before the reader exists: no edge will announce them
        push.send_multipart([b"m", str(i).encode()])

    def sender():
        for i in range(50, n):
            push.send_multipart([b"m", str(i).encode()])

    thread = threading.Thread(target=sender)
    thread.start()
    got = await _collect(lambda cb: (pull, cb, pytest.fail), n)
    thread.join()
    assert got == [b"m" + str(i).encode() for i in range(n)]


async def test_the_loop_gets_turns_while_a_flood_is_read(pull_push):
    pull, push = pull_push
    n = 4 * MAX_MESSAGES_PER_TURN
    for i in range(n):
        push.send(b"x")
    turns = 0

    async def ticker():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        got = await _collect(lambda cb: (pull, cb, pytest.fail), n)
    finally:
        task.cancel()
    assert len(got) == n
    assert turns >= 3  # one read of the whole flood in one callback would have allowed one


async def test_check_after_reading_events_keeps_messages_flowing(pull_push, skip_check=False):
    """Reading zmq.EVENTS may consume the edge the reader waits for; check() recovers it."""
    pull, push = pull_push
    got: list[bytes] = []
    arrived = asyncio.Event()

    def on_frames(frames):
        got.append(frames[0].bytes)
        arrived.set()

    reader = LoopSocket(asyncio.get_running_loop(), pull, on_frames, pytest.fail)
    try:
        for i in range(20):
            arrived.clear()
            push.send(str(i).encode())
            # Without a loop turn: wait for libzmq to deliver, reading EVENTS as the heartbeat
            # check does (which takes the edge away from the loop).
            deadline = time.monotonic() + 5
            while not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
                time.sleep(0.001)
            if not skip_check:
                reader.check()
            await asyncio.wait_for(arrived.wait(), 5)
    finally:
        reader.close()
    assert got == [str(i).encode() for i in range(20)]


async def test_a_failing_handler_stops_the_reader_and_reports(pull_push):
    pull, push = pull_push
    errors: list[BaseException] = []
    failed = asyncio.Event()

    def on_frames(frames):
        raise ValueError(f"cannot handle {frames[0].bytes!r}")

    def on_error(exc):
        errors.append(exc)
        failed.set()

    reader = LoopSocket(asyncio.get_running_loop(), pull, on_frames, on_error)
    push.send(b"bad")
    await asyncio.wait_for(failed.wait(), 5)
    assert reader.closed
    assert len(errors) == 1 and "cannot handle b'bad'" in str(errors[0])
    push.send(b"after")  # nobody reads it any more, nothing is called again
    await asyncio.sleep(0.05)
    assert len(errors) == 1
    reader.close()  # idempotent


async def test_sends_that_find_the_socket_full_wait_in_order_and_never_block(tmp_path):
    """A peer that stops reading fills the socket (high-water marks of one message): sends
    return at once, keep what could not go, in order, and send it when the peer reads again."""
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.bind(f"ipc://{tmp_path}/w")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1)
        push.connect(f"ipc://{tmp_path}/w")
        writer = LoopSocket(asyncio.get_running_loop(), push, None, pytest.fail)
        n = 2000  # (the kernel's socket buffers take a few hundred of these small ones)
        sent_now = [writer.send_multipart([b"m", str(i).encode()]) for i in range(n)]
        assert not all(sent_now) and writer.backlog > 0, "the peer never read: the socket must have filled"
        assert sent_now.index(False) > 0 and not any(sent_now[sent_now.index(False):]), "order kept"
        flushed = asyncio.ensure_future(writer.flushed())
        await asyncio.sleep(0.05)
        assert not flushed.done()
        got = []
        async with asyncio.timeout(10):
            while len(got) < n:
                if pull.poll(0):
                    got.append(pull.recv_multipart()[1])
                else:
                    await asyncio.sleep(0.001)  # the loop sends the backlog as room appears
            await flushed
        assert got == [str(i).encode() for i in range(n)] and writer.backlog == 0
        writer.close()
        assert writer.closed
        with pytest.raises(zmq.ZMQError):
            writer.send_multipart([b"after close"])
    finally:
        ctx.destroy(linger=0)
