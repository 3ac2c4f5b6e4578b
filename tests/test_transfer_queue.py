"""TransferQueue against a real server process: slime's HTTP shapes, RPC, blocking and streaming
reads, limits, spill, timeouts, admin, and recovery after ``kill -9``."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import httpx
import pytest

from omni_engine.transfer_queue import (
    AckUncertainError,
    AsyncTransferQueueClient,
    BufferFullError,
    TransferQueueClient,
    TransferQueueError,
)
from tests.tq_helpers import ServerProcess, trajectory

# The seed's example write, byte for byte.
SEED_WRITE = {
    "uid": "a3b8d1b6-0b3b-4b1a-9c1a-1a2b3c4d5e6f",
    "instance_id": "math_42",
    "messages": [
        {"role": "user", "content": "Solve: 2x + 3 = 7"},
        {"role": "assistant", "content": "x = 2\n\\boxed{2}"},
    ],
    "reward": 1.0,
    "extra_info": {"timestamp": "1707900000.0", "finish_reason": "stop", "label": "2"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--group-size", "4", "--ack-timeout-seconds", "1", data_dir=tmp_path_factory.mktemp("tq")) as proc:
        yield proc


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.post("/buffer/reset").raise_for_status()
        client.post("/config", json={"group_size": 4, "max_memory_bytes": 1 << 30, "spill_to_disk_threshold": 0.8,
                                     "max_disk_bytes": 1 << 34, "uid_dedup": True, "group_timeout_seconds": None,
                                     "group_timeout_policy": "deliver_partial"}).raise_for_status()
        yield client


def _post(url: str, body: bytes) -> tuple[int, dict]:
    """What slime's generator does: ``requests.post(url, json=data)`` (here with urllib)."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_slime_shaped_write_and_read(server, http):
    status, body = _post(f"{server.url}/buffer/write", json.dumps(SEED_WRITE).encode())
    assert status == 200
    assert body == {"success": True, "message": "Data has been successfully written to buffer",
                    "data": {"data": [SEED_WRITE], "meta_info": "write to buffer"}}
    # Not ready (1 of 4): slime's "no data" answer, HTTP 200.
    status, body = _post(f"{server.url}/get_rollout_data", b"{}")
    assert (status, body) == (200, {"success": False, "message": "No data available to read",
                                    "data": {"data": [], "meta_info": {}}})
    others = [dict(SEED_WRITE, uid=f"u{i}", reward=float(i % 2)) for i in range(3)]
    for item in others:
        assert _post(f"{server.url}/buffer/write", json.dumps(item).encode())[0] == 200
    status, body = _post(f"{server.url}/get_rollout_data", b"{}")
    assert status == 200 and body["success"] is True
    assert body["message"] == "Successfully read 4 items"
    assert body["data"]["data"] == [SEED_WRITE, *others]  # unchanged, unknown fields and all
    assert body["data"]["meta_info"] == {"total_samples": 4, "num_groups": 1, "avg_group_size": 4.0,
                                         "avg_reward": 0.5, "finished_groups": ["math_42"]}
    # Consumed: read once.
    assert _post(f"{server.url}/get_rollout_data", b"{}")[1]["success"] is False


def test_write_is_idempotent_by_uid_and_unknown_fields_survive(http):
    item = dict(trajectory("dup", "i-dup"), task_type="math", tool_calls=[{"name": "calc"}])
    for _ in range(3):
        assert http.post("/buffer/write", json=item).status_code == 200
    status = http.get("/status").json()
    assert status["total_trajectories"] == 1 and status["duplicates_dropped"] == 2
    http.post("/config", json={"group_size": 1})
    for i in range(3):  # the group of 4 still waits for 3 more
        http.post("/buffer/write", json=dict(item, uid=f"dup{i}"))
    data = http.post("/get_rollout_data", json={}).json()["data"]["data"]
    assert data[0] == item and len(data) == 4


def test_bad_input_is_refused_naming_the_field(http):
    r = http.post("/buffer/write", json={"instance_id": "x"})
    assert r.status_code == 400 and "uid" in r.json()["message"]
    r = http.post("/buffer/write", json={"uid": 3, "instance_id": "x"})
    assert r.status_code == 400 and "$.uid" in r.json()["message"]
    r = http.post("/buffer/write", content=b"{not json")
    assert r.status_code == 400
    r = http.post("/config", json={"group_sise": 3})
    assert r.status_code == 400 and "group_sise" in r.json()["message"]
    r = http.post("/config", json={"group_size": 0})
    assert r.status_code == 400 and "group_size must be >= 1" in r.json()["message"]
    r = http.post("/get_rollout_data", json={"max_group": 1})
    assert r.status_code == 400 and "max_group" in r.json()["message"]
    assert http.get("/nope").status_code == 404
    assert http.get("/buffer/write").status_code == 405
    assert http.get("/health").json() == {"status": "ok"}  # and nothing above broke it


def test_rpc_batch_write_read_status(server, http):
    with TransferQueueClient(rpc_address=server.rpc) as client:
        batch = [trajectory(f"r{i}", f"inst{i // 4}", reward=i % 2) for i in range(10)]
        result = client.batch_write(batch + batch[:2])
        assert (result.written, result.duplicates, result.refused) == (10, 2, 0)
        status = client.status()
        assert status.pending_groups == 2 and status.incomplete_groups == 1
        got = client.read(max_groups=1)
        assert [g.instance_id for g in got.groups] == ["inst0"]
        assert [t.uid for t in got.groups[0].trajectories] == ["r0", "r1", "r2", "r3"]
        assert got.groups[0].is_complete and got.meta_info.avg_reward == 0.5
        # An RPC write is read over HTTP as JSON (converted once, on the way out).
        body = http.post("/get_rollout_data", json={}).json()
        assert [t["uid"] for t in body["data"]["data"]] == ["r4", "r5", "r6", "r7"]
        assert body["data"]["data"][0]["messages"] == batch[4]["messages"]


def test_rpc_bad_batch_is_refused_naming_the_trajectory(server, http):
    """A BatchWrite with one bad trajectory takes none of the batch and says which one; the
    connection goes on working."""
    import msgspec

    from omni_engine.transfer_queue.client import _check
    from omni_engine.transfer_queue.rpc_protocol import CallHeader, RpcType

    with TransferQueueClient(rpc_address=server.rpc) as client:
        good = [trajectory(f"bad-batch-{i}", "bad-batch") for i in range(3)]
        with pytest.raises(TransferQueueError, match=r"BatchWrite: invalid trajectory in the batch: .*\$\[1\]"):
            client.batch_write([good[0], {"uid": "no-instance"}, good[2]])
        with pytest.raises(TransferQueueError, match=r"\$\[2\]\.uid` is empty"):
            client.batch_write([good[0], good[1], dict(good[2], uid="")])
        assert http.get("/status").json()["total_trajectories"] == 0
        # Not the protocol's shape: a frame per trajectory instead of one batch frame.
        frames = client._call(RpcType.BATCH_WRITE, CallHeader(client.next_id()),
                              [msgspec.msgpack.encode(t) for t in good])
        with pytest.raises(TransferQueueError, match="expected one batch frame after the header, got 3"):
            _check(frames, "BatchWrite")
        assert client.batch_write(good).written == 3


def test_blocking_read_is_woken_by_the_completing_write(server, http):
    for i in range(3):
        http.post("/buffer/write", json=trajectory(f"b{i}", "blk"))
    got: dict = {}

    def reader():
        with TransferQueueClient(rpc_address=server.rpc) as client:
            t0 = time.monotonic()
            got["result"] = client.read(block=True, timeout=30)
            got["at"] = time.monotonic()
            got["waited"] = got["at"] - t0

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.5)
    assert "result" not in got  # blocked: nothing ready
    written_at = time.monotonic()
    http.post("/buffer/write", json=trajectory("b3", "blk"))
    thread.join(30)
    assert [t.uid for t in got["result"].groups[0].trajectories] == ["b0", "b1", "b2", "b3"]
    assert got["waited"] >= 0.5 and got["at"] - written_at < 5
    # Over HTTP too (timeout_ms), and a timeout answers "no data".
    t0 = time.monotonic()
    body = http.post("/get_rollout_data", json={"timeout_ms": 300}).json()
    assert body["success"] is False and time.monotonic() - t0 >= 0.3


async def test_async_client_many_calls_on_one_socket_timeouts_and_close():
    """Replies reach their own calls whatever their order; a call nobody answers times out;
    close() ends the calls still waiting instead of leaving them to their timeouts."""
    import asyncio

    import msgspec
    import zmq

    from omni_engine.transfer_queue.rpc_protocol import RpcResult, RpcType

    ctx = zmq.Context()
    peer = ctx.socket(zmq.ROUTER)  # a server that answers in reverse order, and not call 3
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    try:
        client = AsyncTransferQueueClient(rpc_address=f"tcp://127.0.0.1:{port}", timeout=0.5)
        t0 = time.monotonic()  # (before the calls: their timers start after it)
        calls = [asyncio.ensure_future(client.status()) for _ in range(3)]
        got = []
        while len(got) < 3:
            assert await asyncio.get_running_loop().run_in_executor(None, peer.poll, 5000)
            got.append(peer.recv_multipart())
        status = {"total_trajectories": 0, "total_consumed": 0, "pending_groups": 0, "incomplete_groups": 0,
                  "memory_usage_bytes": 0, "disk_usage_bytes": 0}
        for identity, _, header in reversed(got[:2]):
            call_id = msgspec.msgpack.decode(header)[0]
            value = dict(status, pending_groups=call_id)
            peer.send_multipart([identity, RpcType.RESULT.value, msgspec.msgpack.encode(RpcResult(call_id, True, value))])
        first, second = await calls[0], await calls[1]
        assert (first.pending_groups, second.pending_groups) == (1, 2)
        with pytest.raises(TransferQueueError, match="GET_STATUS: no reply from tcp://127.0.0.1"):
            await calls[2]
        assert 0.45 < time.monotonic() - t0 < 5
        waiting = asyncio.ensure_future(client.status())
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(TransferQueueError, match="the client was closed"):
            await asyncio.wait_for(waiting, 5)
    finally:
        ctx.destroy(linger=0)


async def test_subscribe_pushes_within_its_credit(server, http):
    http.post("/config", json={"group_size": 1})
    async with AsyncTransferQueueClient(rpc_address=server.rpc) as client:
        await client.batch_write([trajectory(f"s{i}", f"sub{i}") for i in range(5)])
        stream = client.subscribe(prefetch_groups=2)
        first = await stream.__anext__()
        assert first.instance_id == "sub0"
        # Two sent ahead at most: one taken, one more in flight, three still queued.
        await _until(lambda: http.get("/status").json()["pending_groups"] == 3)
        # (Short: the groups sent ahead wait unacknowledged meanwhile, and the server's ack timeout is
        # 1 s; a 0.5 s window once took a slow machine past it.)
        time_left = time.monotonic() + 0.2
        while time.monotonic() < time_left:
            assert http.get("/status").json()["pending_groups"] >= 2
        rest = [await stream.__anext__() for _ in range(4)]
        assert [g.instance_id for g in rest] == [f"sub{i}" for i in range(1, 5)]
        await client.batch_write([trajectory("s-late", "late")])  # pushed as it becomes ready
        assert (await stream.__anext__()).instance_id == "late"
        await stream.aclose()


async def _until(cond, timeout: float = 10.0) -> None:
    import asyncio

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_full_buffer_refuses_with_503_and_a_typed_rpc_error(server, http):
    # Memory first, then the spill budget: incomplete groups fill both, then writes are refused.
    http.post("/config", json={"max_memory_bytes": 4000, "spill_to_disk_threshold": 1.0, "max_disk_bytes": 2000,
                               "group_size": 2})
    accepted = 0
    for i in range(100):
        r = http.post("/buffer/write", json=trajectory(f"f{i}", f"full{i}", size=200))
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert "max_disk_bytes 2000" in r.json()["message"]
            break
        accepted += 1
    assert 10 < accepted < 20
    # A write that completes a group must be held in memory: refused there too, naming that limit.
    r = http.post("/buffer/write", json=trajectory("f0b", "full0", size=200))
    assert r.status_code == 503 and "max_memory_bytes 4000" in r.json()["message"]
    with TransferQueueClient(rpc_address=server.rpc) as client:
        with pytest.raises(BufferFullError) as err:
            client.batch_write([trajectory("f-rpc", "full-rpc", size=200)])
        assert err.value.retry_after_s and err.value.result.refused == 1
    status = http.get("/status").json()
    assert status["writes_refused"] == 3 and status["total_trajectories"] == accepted  # nothing half-taken


def test_spill_to_disk_and_read_back(server, http):
    http.post("/config", json={"max_memory_bytes": 20_000, "spill_to_disk_threshold": 0.5, "group_size": 2})
    items = [trajectory(f"sp{i}", f"spill{i}", size=1000) for i in range(30)]  # ~33 KB: > 10 KB in memory
    for item in items:
        assert http.post("/buffer/write", json=item).status_code == 200
    status = http.get("/status").json()
    assert status["memory_usage_bytes"] <= 10_000 and status["incomplete_groups"] == 30
    assert status["disk_usage_bytes"] > 20_000
    data = []
    for n, item in enumerate(items, 1):  # complete the groups; each read brings the spilled halves back
        assert http.post("/buffer/write", json=dict(item, uid=item["uid"] + "b")).status_code == 200
        if n % 5 == 0:
            body = http.post("/get_rollout_data", json={}).json()
            assert body["data"]["meta_info"]["num_groups"] == 5
            data += body["data"]["data"]
    assert sorted(t["uid"] for t in data) == sorted([i["uid"] for i in items] + [i["uid"] + "b" for i in items])
    assert {t["uid"]: t for t in data}["sp17"] == items[17]
    assert http.get("/status").json()["memory_usage_bytes"] == 0


def test_group_timeout_policies(server, http):
    http.post("/config", json={"group_size": 3, "group_timeout_seconds": 0.3, "group_timeout_policy": "drop"})
    http.post("/buffer/write", json=trajectory("t0", "dropme"))
    time.sleep(0.8)
    assert http.get("/status").json()["groups_timed_out_dropped"] == 1
    http.post("/config", json={"group_timeout_policy": "deliver_partial"})
    http.post("/buffer/write", json=trajectory("t1", "partial"))
    http.post("/buffer/write", json=trajectory("t2", "partial"))
    with TransferQueueClient(rpc_address=server.rpc) as client:
        got = client.read(block=True, timeout=10)
    assert got.groups[0].instance_id == "partial" and not got.groups[0].is_complete
    assert [t.uid for t in got.groups[0].trajectories] == ["t1", "t2"]


def test_delete_instance_and_reset(server, http):
    with TransferQueueClient(url=server.url) as client:
        client.batch_write([trajectory(f"d{i}", "gone" if i < 5 else "kept") for i in range(7)])
        assert client.delete_instance("gone") == {"groups": 2, "trajectories": 5}
        status = client.status()
        assert (status.pending_groups, status.incomplete_groups) == (0, 1)
        client.write(trajectory("d0", "gone"))  # a late retry of a deleted uid: still a duplicate
        assert client.status().duplicates_dropped == 1
        client.reset()
        status = client.status()
        assert (status.total_trajectories, status.incomplete_groups, status.duplicates_dropped) == (0, 0, 0)
        client.write(trajectory("d0", "gone"))  # reset forgets uids too
        assert client.status().total_trajectories == 1


def test_metrics_and_client_errors(server, http):
    http.post("/buffer/write", json=trajectory("m0", "metrics"))
    text = http.get("/metrics").text
    assert "transfer_queue_trajectories_total 1.0" in text and "transfer_queue_incomplete_groups 1.0" in text
    with TransferQueueClient(rpc_address=server.rpc) as client:
        with pytest.raises(TransferQueueError, match="HTTP call"):
            client.reset()


def test_kill_9_in_a_write_storm_loses_no_acknowledged_write(tmp_path):
    """Writers over HTTP and RPC; a reader consumes; kill -9; restart on the same directory:
    every acknowledged uid is there or was read before, and nothing read is read again. (A read
    whose acknowledgement the kill left unanswered may have consumed or not: either is right,
    and AckUncertainError says which groups.)"""
    data_dir = tmp_path / "tq"
    acked: set[str] = set()
    read_before: list[str] = []
    uncertain: list[str] = []  # received, acknowledgement unanswered: consumed or not, never both
    stop = threading.Event()
    lock = threading.Lock()
    proc = ServerProcess("--group-size", "4", data_dir=data_dir)

    def http_writer(w: int) -> None:
        with httpx.Client(base_url=proc.url, timeout=10) as client:
            for i in range(100_000):
                uid = f"h{w}-{i}"
                try:
                    r = client.post("/buffer/write", json=trajectory(uid, f"h{w}-{i // 4}", size=500))
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    with lock:
                        acked.add(uid)
                if stop.is_set():
                    return

    def rpc_writer(w: int) -> None:
        with TransferQueueClient(rpc_address=proc.rpc, timeout=3) as client:
            for i in range(100_000):
                batch = [trajectory(f"r{w}-{i}-{j}", f"r{w}-{i}", size=500) for j in range(4)]
                try:
                    client.batch_write(batch)
                except TransferQueueError:
                    return
                with lock:
                    acked.update(t["uid"] for t in batch)
                if stop.is_set():
                    return

    def reader() -> None:
        with TransferQueueClient(rpc_address=proc.rpc, timeout=3) as client:
            while not stop.is_set():
                try:
                    got = client.read(block=True, timeout=0.2)
                except AckUncertainError as exc:  # killed between our ACK and its answer
                    uncertain.extend(t.uid for g in exc.groups for t in g.trajectories)
                    return
                except TransferQueueError:
                    return
                read_before.extend(t.uid for g in got.groups for t in g.trajectories)

    threads = [threading.Thread(target=http_writer, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=rpc_writer, args=(w,)) for w in range(2)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 3000 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    stop.set()
    for t in threads:
        t.join(30)
    assert len(acked) >= 3000 and read_before

    with ServerProcess(data_dir=data_dir) as again, TransferQueueClient(rpc_address=again.rpc) as client:
        assert again.info["recovered_records"] > 0
        client.configure  # (admin over HTTP is not needed here)
        recovered: list[str] = []
        status = client.status()
        while (got := client.read()).success:
            recovered.extend(t.uid for g in got.groups for t in g.trajectories)
        # Incomplete groups hold the rest: complete them by a timeout that delivers them.
        with TransferQueueClient(url=again.url) as admin:
            admin.configure(group_timeout_seconds=0.05, group_timeout_policy="deliver_partial")
        deadline = time.monotonic() + 30
        while client.status().incomplete_groups and time.monotonic() < deadline:
            time.sleep(0.05)
        while (got := client.read()).success:
            recovered.extend(t.uid for g in got.groups for t in g.trajectories)
    assert status.total_trajectories >= len(acked)
    assert not set(read_before) & set(recovered), "a consumed trajectory was delivered again"
    assert len(recovered) == len(set(recovered))
    missing = acked - set(read_before) - set(recovered) - set(uncertain)
    assert not missing, f"{len(missing)} acknowledged writes lost, e.g. {sorted(missing)[:5]}"


def test_restart_keeps_config_and_refuses_nothing_twice(tmp_path):
    data_dir = tmp_path / "tq"
    with ServerProcess("--group-size", "2", data_dir=data_dir) as proc:
        with TransferQueueClient(url=proc.url, rpc_address=proc.rpc) as client:
            client.batch_write([trajectory(f"c{i}", f"c{i // 2}") for i in range(5)])
            assert len(client.read(max_groups=1).groups) == 1
    # Restarted without flags: the logged group size holds; the consumed group stays consumed.
    with ServerProcess(data_dir=data_dir) as proc:
        # A second queue on the same directory would interleave its log with this one's: refused.
        with pytest.raises(RuntimeError, match=f"data directory {data_dir} is in use by another transfer "
                                               f"queue \\(pid {proc.proc.pid}\\)"):
            ServerProcess(data_dir=data_dir)
        with TransferQueueClient(url=proc.url, rpc_address=proc.rpc) as client:
            status = client.status()
            assert (status.pending_groups, status.incomplete_groups, status.total_consumed) == (1, 1, 2)
            client.write(trajectory("c5", "c2"))
            assert [g.instance_id for g in client.read().groups] == ["c1", "c2"]
            assert client.batch_write([trajectory("c0", "c0")]).duplicates == 1
            uid = str(uuid.uuid4())
            assert client.write(trajectory(uid, "fresh")).written == 1


def test_example_generator_feeds_whole_groups(server, http):
    """The example generator (slime's base_generator shape) posts out of order from 8 threads;
    the reader gets each prompt's samples as one group, all of them, once."""
    from omni_engine.transfer_queue.example_generator import run

    http.post("/config", json={"group_size": 16})
    assert run(server.url, instances=6, samples=16, workers=8) == 96
    body = http.post("/get_rollout_data", json={}).json()
    meta = body["data"]["meta_info"]
    assert (meta["total_samples"], meta["num_groups"], meta["avg_group_size"]) == (96, 6, 16.0)
    assert sorted(meta["finished_groups"]) == [f"math_{i}" for i in range(6)]
    rewards = [t["reward"] for t in body["data"]["data"]]
    assert set(rewards) <= {0.0, 1.0} and meta["avg_reward"] == sum(rewards) / 96


def test_groups_a_reader_never_acknowledges_go_to_the_next(server, http):
    """Two-phase RPC reads: a reader that takes groups and vanishes before its ACK loses nothing."""
    import msgspec
    import zmq

    from omni_engine.transfer_queue.rpc_protocol import BatchReadRequest, RpcType

    http.post("/config", json={"group_size": 2})
    with TransferQueueClient(rpc_address=server.rpc) as client:
        client.batch_write([trajectory(f"n{i}", f"nack{i // 2}") for i in range(4)])
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.rpc)
        sock.send_multipart([RpcType.BATCH_READ.value, msgspec.msgpack.encode(BatchReadRequest(7, 1))])
        assert sock.poll(10_000)
        frames = sock.recv_multipart()
        header = msgspec.msgpack.decode(frames[1])
        assert frames[0] == RpcType.GROUPS.value and header[0] == 7 and len(frames) == 3  # type, header, batch
        assert [t["uid"] for t in msgspec.msgpack.decode(frames[2])] == ["n0", "n1"]
        assert http.get("/status").json()["pending_groups"] == 1  # handed out: not readable by others
    finally:
        ctx.destroy(linger=0)  # gone without an ACK
    with TransferQueueClient(rpc_address=server.rpc) as client:
        t0 = time.monotonic()
        first = client.read(max_groups=1, block=True, timeout=10)
        second = client.read(max_groups=1, block=True, timeout=10)
    assert sorted(g.instance_id for g in first.groups + second.groups) == ["nack0", "nack1"]
    assert time.monotonic() - t0 < 5
    assert http.get("/status").json()["total_consumed"] == 4


def test_a_waiting_http_read_whose_client_hangs_up_takes_nothing(server, http):
    http.post("/config", json={"group_size": 2})
    http.post("/buffer/write", json=trajectory("hu0", "hangup"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/get_rollout_data", json={"timeout_ms": 3000}, timeout=0.5)
    http.post("/buffer/write", json=trajectory("hu1", "hangup"))  # completes the group after the hang-up
    time.sleep(0.2)
    body = http.post("/get_rollout_data", json={"timeout_ms": 2000}).json()
    assert [t["uid"] for t in body["data"]["data"]] == ["hu0", "hu1"]
