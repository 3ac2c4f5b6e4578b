"""Hostile input on both sockets of a stage connection, against real processes.

(a) A stage process's input (through a raw ROUTER, so every answer is seen):
    random, truncated and mistyped frames, lying tensor headers, shared-memory
    handles of missing or foreign segments, pickles, duplicates and
    out-of-order requests. It answers ERROR where the request id is readable,
    stays up, leaks nothing, and serves the next valid request correctly.
(b) A client's PULL socket, from a stranger's PUSH: garbage, outputs for
    unknown requests, answers to calls never made, a second READY. The client
    drops them, is not marked dead, and a valid request completes.

The long version is ``tests/stress/fuzz_sockets.py``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import zmq
from msgspec.msgpack import Ext

from omni_engine.connectors.shm import SEGMENT_INDEX, ShmPool, list_segments, stage_prefix
from omni_engine.wire.protocol import (
    InputStream,
    StageAbortRequest,
    StageGenerateRequest,
    StageReady,
    StageReleaseRequest,
    StageRequestType,
    StageResponseType,
    StageUtilityRequest,
)
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.wire.stage_serialization import CustomType
from tests.helpers import RawFrameClient, collect
from tests.wire_fuzz import OutputInjector, RawStage, fuzz_stage_spec, stage_barrage

RAW_STAGE_ID, CLIENT_STAGE_ID = 9, 8
SHM_BYTES = 2 << 20  # above the shared-memory threshold: the answer travels as a handle
EXAMPLES = 150  # per socket; tests/stress/fuzz_sockets.py runs many more


@pytest.fixture(scope="module")
def raw_stage():
    stage = RawStage(RAW_STAGE_ID, fuzz_stage_spec())
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def foreign_segment():
    """A real segment of another run (pid 1's prefix): no stage of ours may attach it."""
    pool = ShmPool(stage_prefix(f"omni_1_{os.urandom(4).hex()}", 0), max_bytes=1 << 20, min_slot=4096)
    yield pool.lease(4096, "theirs").name
    pool.close()


def _mapped(pid: int, name: str) -> bool:
    return name in Path(f"/proc/{pid}/maps").read_text()


def _serve_valid(stage: RawStage, rid: str) -> None:
    """A valid request through shared memory: right bytes, slot released, nothing running."""
    stage.send(StageRequestType.GENERATE, StageGenerateRequest(rid, {"nbytes": SHM_BYTES}))
    answers = stage.settle()
    (output,) = [o for kind, m in answers if kind is StageResponseType.OUTPUT for o in m.outputs]
    tensor = output.multimodal_output["tensor"]
    assert output.request_id == rid and output.finished and tensor.numel() == SHM_BYTES
    assert bool((tensor == SHM_BYTES % 251).all())
    segment, _ = SEGMENT_INDEX.find(tensor.data_ptr(), SHM_BYTES)
    del tensor, output, answers
    stage.send(StageRequestType.RELEASE, StageReleaseRequest([segment]))
    stage.send(StageRequestType.UTILITY, StageUtilityRequest(1, "shm_stats"))
    kind, stats = stage.recv(10)
    assert kind is StageResponseType.UTILITY_RESULT and stats.result["leased"] == 0, stats


# ------------------------------------------------------------- (a) stage input
def test_stage_input_survives_hostile_frames(raw_stage, foreign_segment):
    _serve_valid(raw_stage, "before")  # the pool now holds its slot
    segments = list_segments(raw_stage.shm_prefix)
    verdicts = stage_barrage(raw_stage, EXAMPLES, (foreign_segment,), derandomize=True)
    # The barrage reached the deep paths, not just the frame count check.
    assert verdicts["malformed with request id"] > EXAMPLES // 10 and verdicts["generate with request id"] > 0
    assert raw_stage.process.is_alive()
    assert not _mapped(raw_stage.process.pid, foreign_segment), "stage attached another run's segment"
    _serve_valid(raw_stage, "after")
    assert list_segments(raw_stage.shm_prefix) == segments  # no segment made or lost


def test_duplicate_abort_and_unknown_names_are_answered_in_order(raw_stage, foreign_segment):
    gen = lambda rid, **p: raw_stage.send(StageRequestType.GENERATE, StageGenerateRequest(rid, {"nbytes": 8, **p}))
    gen("slow", delay=0.5)
    gen("slow")  # the id is running: refused, the running one goes on
    raw_stage.send(StageRequestType.ABORT, StageAbortRequest(["no-such-request"]))
    raw_stage.send(StageRequestType.RELEASE, StageReleaseRequest(["omni_x", foreign_segment, ""]))
    raw_stage.send(StageRequestType.UTILITY, StageUtilityRequest(7, "shutdown"))
    answers = raw_stage.settle()
    errors = [(m.request_id, m.error_type) for k, m in answers if k is StageResponseType.ERROR]
    assert errors == [("slow", "DuplicateRequest")], answers
    (output,) = [o for k, m in answers if k is StageResponseType.OUTPUT for o in m.outputs]
    assert output.request_id == "slow" and output.finished
    (util,) = [m for k, m in answers if k is StageResponseType.UTILITY_RESULT]
    assert util.call_id == 7 and "no utility method 'shutdown'" in util.error
    # ABORT then GENERATE of the same id, back to back: the new request runs.
    gen("again", delay=5)
    raw_stage.send(StageRequestType.ABORT, StageAbortRequest(["again"]))
    gen("again")
    answers = raw_stage.settle()
    assert not [m for k, m in answers if k is StageResponseType.ERROR], answers
    (output,) = [o for k, m in answers if k is StageResponseType.OUTPUT for o in m.outputs]
    assert output.request_id == "again" and output.multimodal_output["tensor"].numel() == 8


def test_input_in_parts_is_refused_by_a_stage_that_cannot_take_it_and_a_stray_part_is_dropped(raw_stage):
    """A GENERATE that opens a request fed in parts (or asks for its states as it generates) reaches a
    generation stage: refused, naming the stage and the request, before anything runs; a part for a
    request that is not running (it ended first) is dropped; the stage serves on."""
    part = StageGenerateRequest("gone", {"nbytes": 8}, input_stream=InputStream.MORE)
    raw_stage.send(StageRequestType.GENERATE, part)
    raw_stage.send(StageRequestType.GENERATE, StageGenerateRequest("parts", {"nbytes": 8},
                                                                   input_stream=InputStream.OPEN))
    raw_stage.send(StageRequestType.GENERATE, StageGenerateRequest("states", {"nbytes": 8}, stream_states=True))
    answers = raw_stage.settle()
    errors = {m.request_id: m.message for k, m in answers if k is StageResponseType.ERROR}
    assert sorted(errors) == ["parts", "states"], answers
    assert f"stage {RAW_STAGE_ID}" in errors["parts"] and "request 'parts'" in errors["parts"]
    assert "takes no input in parts" in errors["parts"]
    assert not [o for k, m in answers if k is StageResponseType.OUTPUT for o in m.outputs], answers
    _serve_valid(raw_stage, "after-parts")


def test_abort_with_final_outputs_ends_the_request_before_its_id_runs_again(raw_stage):
    """ABORT asking for final outputs (what the orchestrator sends, as vLLM's AsyncLLM ends an
    aborted stream): the aborted request ends with a final output marked "abort", and a GENERATE
    of the same id right behind it starts only after that, so the two never interleave."""
    gen = lambda rid, **p: raw_stage.send(StageRequestType.GENERATE, StageGenerateRequest(rid, {"nbytes": 8, **p}))
    gen("again", delay=5)
    raw_stage.send(StageRequestType.ABORT, StageAbortRequest(["again"], final_outputs=True))
    gen("again")
    answers = raw_stage.settle()
    assert not [m for k, m in answers if k is StageResponseType.ERROR], answers
    aborted, output = [o for k, m in answers if k is StageResponseType.OUTPUT for o in m.outputs]
    assert aborted.request_id == "again" and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert output.request_id == "again" and output.multimodal_output["tensor"].numel() == 8


class _Touch:
    """Unpickling this creates a file: proof that a pickle was (not) loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_pickle_is_refused_by_default(raw_stage, tmp_path):
    marker = tmp_path / "unpickled"
    payload = Ext(int(CustomType.PICKLE), pickle.dumps(_Touch(marker)))
    raw_stage.send_frames([StageRequestType.GENERATE.value, msgspec.msgpack.encode(["pickled", payload])])
    (answer,) = raw_stage.settle()
    assert answer[0] is StageResponseType.ERROR and answer[1].request_id == "pickled"
    assert "pickle is disabled" in answer[1].message and "OMNI_ENGINE_ALLOW_PICKLE" in answer[1].message
    assert not marker.exists()


# -------------------------------------------------------- (b) client output side
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fuzz_client():
    client = RawFrameClient(CLIENT_STAGE_ID, process=fuzz_stage_spec())
    await client.start()
    yield client
    await client.shutdown()


async def _check_serves(client: StageEngineCoreClient, rid: str) -> None:
    await client.submit_request(rid, {"nbytes": SHM_BYTES})
    (output,) = await collect(client, rid, timeout=30)
    assert bool((output.multimodal_output["tensor"] == SHM_BYTES % 251).all())
    del output
    await client.check_health()
    assert client.num_unfinished_requests() == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_client_output_socket_survives_hostile_frames(fuzz_client, foreign_segment, tmp_path):
    client = fuzz_client
    await _check_serves(client, "warm")
    attached = len(client.attachments)
    injector = OutputInjector(client)
    marker = tmp_path / "unpickled"
    pickled = [StageResponseType.OUTPUT.value, msgspec.msgpack.encode(
        [[Ext(int(CustomType.PICKLE), pickle.dumps(_Touch(marker)))]])]
    try:
        await asyncio.to_thread(injector.send, pickled)
        await asyncio.to_thread(injector.barrage, EXAMPLES, (foreign_segment,))
    finally:
        injector.close()
    assert not client.is_dead and not marker.exists()
    assert client.num_unfinished_requests() == 0 and client.lease_book.num_tracked() == 0
    assert len(client.attachments) == attached  # no segment of another run (or none at all) was mapped
    await _check_serves(client, "after-barrage")


@pytest.mark.asyncio(loop_scope="session")
async def test_stranger_on_request_socket_is_drained_not_obeyed(fuzz_client, caplog):
    """A second READY (and junk) on the ROUTER, from a peer that is not our stage."""
    client = fuzz_client
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(client.input_address)
    ready = StageReady(CLIENT_STAGE_ID, os.getpid(), client.ready.shm_prefix, {})
    await dealer.send_multipart([StageResponseType.READY.value, msgspec.msgpack.encode(ready)])
    await dealer.send_multipart([b"junk"])
    await dealer.send_multipart([b"\x99", os.urandom(2 << 20)])  # over the READY size limit: ZMQ drops the peer
    try:
        async with asyncio.timeout(10):
            while sum("unexpected" in r.message and "request socket" in r.message for r in caplog.records) < 2:
                await asyncio.sleep(0.01)
        await _check_serves(client, "after-stranger")
        assert not await _poll(dealer, 0.2), "the stranger received something"
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert "unexpected READY from peer" in caplog.text


async def _poll(sock: zmq.asyncio.Socket, timeout: float) -> bool:
    return bool(await sock.poll(timeout * 1000))


@pytest.mark.asyncio(loop_scope="session")
async def test_duplicate_generate_does_not_fail_the_running_request(fuzz_client):
    """A GENERATE for an id in flight, through the client's ROUTER: the stage refuses it,
    and the client keeps (and completes) its own request."""
    client = fuzz_client
    await client.submit_request("mine", {"nbytes": 16, "delay": 0.5})
    body = msgspec.msgpack.encode(["mine", {"nbytes": 1}])
    await client.send_raw(StageRequestType.GENERATE.value, body)
    (output,) = await collect(client, "mine", timeout=30)
    assert output.multimodal_output["tensor"].numel() == 16


@pytest.mark.asyncio(loop_scope="session")
async def test_abort_then_resubmit_same_id(fuzz_client):
    client = fuzz_client
    for _ in range(3):
        await client.submit_request("re", {"nbytes": 4, "delay": 5})
        await client.abort_request("re")
        await client.submit_request("re", {"nbytes": 12})
        (output,) = await collect(client, "re", timeout=30)
        assert output.multimodal_output["tensor"].numel() == 12


@pytest.mark.llm
@pytest.mark.asyncio(loop_scope="session")
async def test_llm_stage_survives_hostile_frames(llm_stage):
    """A few hostile frames through the vLLM stage's ROUTER (it is started for the llm tests anyway)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    for frames in ([b"\x00", b"\xc1"], [b"\x00", msgspec.msgpack.encode(["x", Ext(103, b"\x93")])],
                   [b"\x00", msgspec.msgpack.encode(["y", "hi", Ext(105, b"\x81\xa1n\xff")])],
                   [b"\x03", msgspec.msgpack.encode([1, "collective_rpc", [], {}])[:-3]], [b"\x7f"]):
        await llm_stage.send_raw(*frames)
    await llm_stage.check_health()
    params = SamplingParams(temperature=0.0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    await llm_stage.submit_request("llm-after-garbage", "The capital of France is", params)
    (output,) = await collect(llm_stage, "llm-after-garbage", timeout=60)
    assert output.finished and output.outputs[0].token_ids and not llm_stage.is_dead
