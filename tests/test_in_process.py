"""In-process stages (``runtime.process: false``): the stage runs in the client's process over
``inproc://``, in a thread of its own (``event_loop: own``) or on the client's event loop
(``event_loop: client``), with the framing, abort, failure and shutdown of a stage process."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import numpy as np
import pytest
from zmq.utils.garbage import GarbageCollectorThread

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageDeadError, StageRequestError, StageStartupError
from omni_engine.stage_engine.in_process import ClientLoopStageClient, InProcessStageClient
from tests.helpers import TTS_FACTORY
from tests.stress.checks import wait_clean

pytestmark = [pytest.mark.asyncio(loop_scope="session")]

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day by the river."
EVENT_LOOPS = ["own", "client"]


def in_process_config(factory: str, event_loop: str, output_type: str, engine_args: dict | None = None,
                      **runtime) -> object:
    return parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": factory, **(engine_args or {})},
        "runtime": {"process": False, "event_loop": event_loop, **runtime}, "final_output": True,
        "final_output_type": output_type,
    }]}, f"<in-process test, event_loop {event_loop}>")


class Leftovers:
    """Threads and tasks started after it was made that are still running (earlier tests' may
    end meanwhile: only what is new counts)."""

    def __init__(self) -> None:
        self.threads = set(threading.enumerate())
        self.tasks = asyncio.all_tasks()

    def threads_left(self) -> list[str]:
        # Not counted: pyzmq's collector of zero-copy frames and the loop's default executor
        # (asyncio.to_thread), one each per process and per loop, started at their first use.
        return sorted(t.name for t in set(threading.enumerate()) - self.threads
                      if not isinstance(t, GarbageCollectorThread) and not t.name.startswith("asyncio_"))

    def tasks_left(self) -> list[str]:
        return sorted(t.get_name() for t in asyncio.all_tasks() - self.tasks if t is not asyncio.current_task())


@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
async def test_a_speech_stage_in_process_speaks_aborts_and_leaves_nothing(event_loop):
    config = in_process_config(TTS_FACTORY, event_loop, "audio", max_batch_size=2)
    before = Leftovers()
    client = await MultiStageEngineClient.from_config(config)
    try:
        stage = client.stage_contexts[0].client.replicas[0]
        expected = ClientLoopStageClient if event_loop == "client" else InProcessStageClient
        assert type(stage) is expected and stage.process is None and stage.stage_running
        assert client.replica_status(0)[0].pid == os.getpid()  # READY came from this process
        assert stage.input_address.startswith("inproc://")
        # Own loop: a thread of its own; the client's: none, its task runs on this loop.
        assert (stage.thread is not None) == (event_loop == "own")
        assert (getattr(stage, "task", None) in asyncio.all_tasks()) == (event_loop == "client")
        outs = [o async for o in client.generate(TEXT, None, "speak")]
        audio = np.concatenate([o.multimodal_output["audio"] for o in outs if o.multimodal_output])
        assert outs[-1].finished and len(audio) > 22050  # over a second of speech at 22,050 Hz
        assert outs[-1].multimodal_output["sample_rate"] == 22050
        # Concurrent requests, one left early and one aborted: the rest complete.
        long_text = " ".join([TEXT] * 40)
        gens = [client.generate(long_text, None, f"many-{i}") for i in range(4)]
        first = [asyncio.ensure_future(g.__anext__()) for g in gens[:2]]
        aborted = asyncio.ensure_future(anext(client.generate(long_text, None, "aborted")))
        await asyncio.sleep(0.05)
        await client.abort("aborted")
        async with asyncio.timeout(10):
            final = await aborted
        assert final.finished and final.request_id == "aborted"
        for task in first:
            await task
        await gens[0].aclose()  # leaving early aborts it in the stage
        for gen in gens[1:]:
            async for _ in gen:
                pass
        assert not await wait_clean(client)
    finally:
        await client.shutdown_async()
    assert not stage.stage_running
    assert not before.threads_left()  # the speech model's thread went with its engine
    assert not before.tasks_left()


@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
async def test_an_in_process_stage_that_dies_fails_its_requests_naming_it(event_loop):
    before = Leftovers()
    client = await MultiStageEngineClient.from_config(in_process_config("tests.models:make_fatal", event_loop,
                                                                        "tensor"))
    try:
        # The request fails with the engine's error; the stage then dies of it (a fatal engine error).
        with pytest.raises(StageRequestError, match="stage 0: request 'fatal' failed: device lost"):
            async with asyncio.timeout(10):
                async for _ in client.generate({"x": 1}, None, "fatal"):
                    pass
        stage = client.stage_contexts[0].client.replicas[0]
        async with asyncio.timeout(10):
            while stage.stage_running:
                await asyncio.sleep(0.02)
        with pytest.raises(StageDeadError, match="stage 0: StageEngineError: device lost"):
            await client.check_health()
        with pytest.raises(StageDeadError, match="stage 0"):
            await anext(client.generate({"x": 1}, None, "after"))
    finally:
        await client.shutdown_async()
    assert not before.threads_left() and not before.tasks_left()


@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
async def test_an_in_process_stage_that_fails_to_load_fails_startup_at_once_with_its_error(event_loop):
    """No process sentinel tells of it: the stage's own end does, with the model's error, long
    before the startup timeout."""
    config = in_process_config("tests.models:make_unloadable", event_loop, "tensor")
    before = Leftovers()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StageStartupError, match=r"stage 0 \(in-process\) ended during startup: "
                                                r"FileNotFoundError: weights.bin is missing"):
        await MultiStageEngineClient.from_config(config)
    assert loop.time() - t0 < 10
    assert not before.threads_left() and not before.tasks_left()


@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
async def test_a_model_that_holds_the_clients_loop_is_named_in_a_warning(event_loop, caplog):
    """On the client's loop a model step that computes without awaiting holds every request of
    the process: the stage says so, naming itself and the way out. On a loop of its own it
    holds only its own stage, which is that mode's contract: nothing to say."""
    def holder(hold: float, wait: float) -> object:
        return in_process_config("tests.models:make_loop_holder", event_loop, "tensor", {"hold": hold, "wait": wait})

    async def ask(client: MultiStageEngineClient, request_id: str) -> None:
        async with asyncio.timeout(10):
            outs = [o async for o in client.generate({"x": 1}, None, request_id)]
        assert outs[-1].finished

    def holds_of(client: MultiStageEngineClient):
        return getattr(client.stage_contexts[0].client.replicas[0], "loop_holds", None)

    caplog.set_level(logging.WARNING, logger="omni_engine.engines.loop_holds")
    # Control: a model that only awaits (0.3 s of waiting, no hold) has no step near that long.
    async with await MultiStageEngineClient.from_config(holder(0.0, 0.3)) as client:
        await ask(client, "waits")
        assert holds_of(client) is None if event_loop == "own" else holds_of(client).longest_s < 0.3
    async with await MultiStageEngineClient.from_config(holder(0.3, 0.0)) as client:
        for i in range(3):
            await ask(client, f"holds-{i}")
        report = holds_of(client)
    warnings = [r.getMessage() for r in caplog.records if r.name == "omni_engine.engines.loop_holds"]
    if event_loop == "own":
        assert report is None and not warnings
        return
    assert report.holds >= 3 and report.longest_s >= 0.3
    # Rate-limited: one warning for three holds in a row.
    assert len(warnings) == 1, warnings
    assert "stage 0: its model held the client's event loop for 0.3" in warnings[0]
    assert "runtime.event_loop: own" in warnings[0]


async def test_event_loop_is_checked_where_the_config_is_read():
    """``event_loop`` is for in-process stages only, and takes one of its two values."""
    from omni_engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"stage_args\[0\].runtime.event_loop: 'main' is not one of"):
        in_process_config(TTS_FACTORY, "main", "audio")
    with pytest.raises(ConfigError, match=r"stage_args\[0\].runtime.event_loop: applies to in-process stages "
                                          r"only \(process: false\)"):
        in_process_config(TTS_FACTORY, "client", "audio", process=True)
