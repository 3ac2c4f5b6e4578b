"""A real stage process (eSpeak NG speech) over real ZMQ sockets: lifecycle and errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_engine.connectors.shm import list_segments
from omni_engine.params import SpeechParams
from omni_engine.errors import StageRequestError, StageStartupError
from omni_engine.wire.protocol import StageRequestType
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_process import StageProcess, StageProcessSpec
from tests.helpers import collect, external_transport, process_exists, tts_spec, wait_group_gone

pytestmark = pytest.mark.tts  # async tests: the session loop (pyproject.toml)


async def test_speech_stage_returns_plausible_audio(tts_stage):
    text = "The capital of France is Paris. It is a beautiful city."
    await tts_stage.submit_request("speech-1", text, SpeechParams(voice="en"))
    (output,) = await collect(tts_stage, "speech-1")
    assert output.stage_id == 1 and output.final_output_type == "audio"
    audio, rate = output.multimodal_output["audio"], output.multimodal_output["sample_rate"]
    assert rate == 22050 and audio.dtype == np.float32 and audio.ndim == 1
    seconds = len(audio) / rate
    assert 1.5 < seconds < 10, f"{seconds:.2f} s of audio for {len(text.split())} words"
    assert float(np.sqrt(np.mean(audio**2))) > 0.01, "audio is silence"


async def test_concurrent_speech_requests_are_batched_and_all_answered(tts_stage):
    texts = {f"batch-{i}": f"Sentence number {i} is spoken here." for i in range(8)}
    for rid, text in texts.items():
        await tts_stage.submit_request(rid, text, {"speed": 1.5})
    seen: dict[str, float] = {}
    async with asyncio.timeout(60):
        while len(seen) < len(texts):
            for output in await tts_stage.get_outputs_async():
                seen[output.request_id] = len(output.multimodal_output["audio"])
    assert set(seen) == set(texts) and all(n > 10000 for n in seen.values())
    assert tts_stage.num_unfinished_requests() == 0


async def test_bad_request_fails_alone_and_names_stage_request_and_field(tts_stage):
    await tts_stage.submit_request("bad-voice", "Hello there.", {"voice": "no-such-voice"})
    with pytest.raises(StageRequestError) as info:
        await tts_stage.get_output_async()
    err = info.value
    assert err.stage_id == 1 and err.request_id == "bad-voice"
    assert "stage 1" in str(err) and "bad-voice" in str(err) and "no-such-voice" in str(err)
    # The stage lives on.
    await tts_stage.submit_request("after-bad", "Still alive.", None)
    (output,) = await collect(tts_stage, "after-bad")
    assert len(output.multimodal_output["audio"]) > 0


async def test_malformed_frames_are_answered_and_not_fatal(tts_stage):
    await tts_stage.send_raw(b"\x7f", b"\x00")  # unknown type
    await tts_stage.send_raw(StageRequestType.GENERATE.value, b"\xc1garbage")  # bad msgpack
    await tts_stage.send_raw(StageRequestType.GENERATE.value)  # missing body
    await tts_stage.check_health()
    await tts_stage.submit_request("after-garbage", "Valid again.", None)
    (output,) = await collect(tts_stage, "after-garbage")
    assert output.finished and len(output.multimodal_output["audio"]) > 0


async def test_duplicate_request_id_is_rejected_locally(tts_stage):
    await tts_stage.submit_request("dup", "One.", None)
    with pytest.raises(ValueError, match="dup"):
        await tts_stage.submit_request("dup", "Two.", None)
    await collect(tts_stage, "dup")


async def test_utility_calls_reach_only_allowed_methods(tts_stage):
    info = await tts_stage.call_utility_async("info")
    assert info["sample_rate"] == 22050 and info["max_batch_size"] == 4
    with pytest.raises(RuntimeError, match="no utility method 'shutdown'"):
        await tts_stage.call_utility_async("shutdown")


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_shutdown_leaves_no_process_socket_or_segment(transport):
    client = StageEngineCoreClient(2, process=tts_spec(), transport=transport)
    await client.start()
    assert client.input_address.startswith(f"{transport}://")
    if transport == "tcp":
        assert client.input_address.startswith("tcp://127.0.0.1:")
    pid = client.process.pid
    await client.submit_request("x", "Shutting down soon.", None)
    await collect(client, "x")
    await client.shutdown()
    assert not process_exists(pid) and not await wait_group_gone(pid)
    assert not client.runtime_dir.exists()  # socket files (ours and the stage's) are gone
    assert not list_segments(client.shm_prefix)
    await client.shutdown()  # idempotent


async def test_startup_failure_names_stage_exit_code_and_log():
    spec = StageProcessSpec("generation", {"model_factory": "omni_engine.no_such_module:make"})
    client = StageEngineCoreClient(5, process=spec, startup_timeout=120)
    with pytest.raises(StageStartupError) as info:
        await client.start()
    message = str(info.value)
    assert info.value.stage_id == 5 and info.value.exit_code == 1
    assert "stage 5" in message and "exited with code 1" in message
    assert "omni_engine.no_such_module" in message  # the log tail shows the cause
    assert not process_exists(client.process.pid)


async def test_startup_timeout_kills_the_stage():
    spec = StageProcessSpec("generation", {"model_factory": "tests.models:make_slow_loader", "seconds": 60})
    client = StageEngineCoreClient(6, process=spec, startup_timeout=2.0)
    with pytest.raises(StageStartupError, match="did not become ready within"):
        await client.start()
    assert not process_exists(client.process.pid)


def test_a_stage_started_with_a_foreign_shm_prefix_is_refused_before_it_spawns():
    """A client ignores a READY whose prefix is not a stage prefix (it decides what is
    unlinked when the stage dies), so such a stage would never start: say so at once."""
    with pytest.raises(ValueError, match=r"stage 3: shm_prefix 'omni_external_s0' is not a stage prefix"):
        StageProcess(3, tts_spec().replace(
            transport=external_transport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "omni_external_s0")))


async def test_stale_socket_dirs_of_dead_clients_are_removed_at_start(tmp_path):
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Path(tempfile.gettempdir()) / f"omni-{int(dead.stdout)}-s0-stale"
    (stale / "in").mkdir(parents=True)
    mine = Path(tempfile.gettempdir()) / f"omni-{os.getpid()}-s0-live"
    mine.mkdir()
    client = StageEngineCoreClient(7, process=tts_spec())
    try:
        await client.start()
        assert not stale.exists() and mine.exists()
    finally:
        await client.shutdown()
        mine.rmdir()


async def test_a_stage_on_another_host_that_sends_a_shm_handle_is_stopped_loudly():
    """A stage whose READY names another host (its ``host_id``) but sends a shared-memory handle
    anyway: the client refuses the handle, and, since the stage broke what its handshake said,
    the stage with it: the request fails at once, naming stage and cause, nothing hangs."""
    from omni_engine.connectors.settings import ConnectorSettings
    from omni_engine.errors import StageDeadError

    spec = tts_spec().replace(host_id="another-host/boot/1")
    client = StageEngineCoreClient(1, process=spec, connectors=ConnectorSettings(shm_threshold=0))
    await client.start()
    try:
        assert client.ready.host_id == "another-host/boot/1" != client.host_id
        await client.submit_request("foreign-1", "A sentence long enough to leave as a tensor.", {})
        with pytest.raises(StageDeadError, match="stage 1: .*shared-memory segment .*another host "
                                                 r"\(another-host/boot/1\)"):
            async with asyncio.timeout(30):
                await client.get_output_async()
        assert client.num_unfinished_requests() == 0
    finally:
        await client.shutdown()
    assert not process_exists(client.process.pid) and not list_segments(client.shm_prefix)


@pytest.mark.parametrize("io", ["loop", "threads"])
async def test_both_io_modes_serve_abort_health_and_heartbeats(io):
    """``runtime.io``: the stage's sockets on its event loop or in threads; the same answers
    either way, and a stage given a heartbeat interval says it is alive while idle."""
    spec = tts_spec().replace(io=io, heartbeat_interval=0.05)
    client = StageEngineCoreClient(3, process=spec)
    await client.start()
    try:
        heard = client._last_heard
        await asyncio.sleep(0.3)  # idle: only heartbeats arrive
        assert client._last_heard > heard
        await client.submit_request("long", "A sentence that takes a while to speak, said slowly. " * 4,
                                    {"speed": 0.5})
        await client.submit_request("short", "Short.", None)
        await client.abort_request("long")
        (output,) = await collect(client, "short")
        assert output.finished and len(output.multimodal_output["audio"]) > 0
        await client.check_health()
        assert await client.call_utility_async("num_unfinished_requests") == 0
    finally:
        await client.shutdown()
    assert not process_exists(client.process.pid)


async def test_generates_of_one_loop_turn_go_as_one_message_and_nothing_overtakes_them():
    """The first GENERATE of a loop turn leaves at once, the rest of that turn as one
    GENERATE_BATCH; an ABORT in the same turn goes after them, so it reaches its request."""
    spec = StageProcessSpec("generation", {"model_factory": "tests.models:make_checked_tensor_source"},
                            max_batch_size=8)
    client = StageEngineCoreClient(4, process=spec)
    await client.start()
    try:
        sent: list[bytes] = []
        send = client._requests_out.send_multipart
        client._requests_out.send_multipart = lambda frames, copy=False: sent.append(frames[1]) or send(frames, copy)
        rids = [f"turn-{i}" for i in range(6)]
        for rid in rids:  # (no await here suspends: one loop turn)
            await client.submit_request(rid, {"nbytes": 8, "delay": 3.0 if rid == "turn-3" else 0.0}, None)
        await client.abort_request("turn-3", keep_final=True)
        assert sent == [StageRequestType.GENERATE.value, StageRequestType.GENERATE_BATCH.value,
                        StageRequestType.ABORT.value]
        finals = {}
        async with asyncio.timeout(2.5):  # turn-3 ends by its abort, not after its 3 s
            while len(finals) < len(rids):
                for output in await client.get_outputs_async():
                    finals[output.request_id] = output
        assert finals["turn-3"].outputs[0].finish_reason == "abort"
        assert all(finals[rid].multimodal_output["tensor"].numel() == 8 for rid in rids if rid != "turn-3")
        assert await client.call_utility_async("num_unfinished_requests") == 0
    finally:
        await client.shutdown()


async def test_the_outputs_of_one_batch_leave_as_one_message():
    """A batched engine's answers to one batch go out together (a request's end, which the
    stage marks for its shared-memory pool, does not split them), so a client reading many
    small answers pays per message, not per answer; the requests of one loop turn leave in
    pieces of GENERATES_PER_MESSAGE, so the stage starts before the client has encoded them all."""
    spec = StageProcessSpec("generation", {"model_factory": "tests.models:make_checked_tensor_source"},
                            max_batch_size=64)
    client = StageEngineCoreClient(5, process=spec)
    await client.start()
    try:
        messages: list[int] = []
        on_outputs = client._on_outputs
        client._on_outputs = lambda outputs, timings=None: messages.append(len(outputs)) or on_outputs(outputs, timings)
        sent: list[bytes] = []
        send_multipart = client._requests_out.send_multipart
        client._requests_out.send_multipart = lambda frames, **kw: (
            sent.append(bytes(frames[1])) or send_multipart(frames, **kw))
        rids = [f"batch-{i}" for i in range(40)]
        for rid in rids:  # one loop turn: one GENERATE, then GENERATE_BATCHes of 32 and 7
            await client.submit_request(rid, {"nbytes": 8}, None)
        await asyncio.sleep(0)  # (the turn's end sends the last piece)
        assert sent == [StageRequestType.GENERATE.value, StageRequestType.GENERATE_BATCH.value,
                        StageRequestType.GENERATE_BATCH.value]
        finals = set()
        async with asyncio.timeout(30):
            while len(finals) < len(rids):
                finals.update(output.request_id for output in await client.get_outputs_async())
        assert sum(messages) == len(rids)
        # The first request alone, the pieces' answers in one or two messages each.
        assert len(messages) <= 5, messages
        assert await client.call_utility_async("num_unfinished_requests") == 0
    finally:
        await client.shutdown()
    assert not process_exists(client.process.pid)
