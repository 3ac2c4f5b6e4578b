"""Stages placed through Ray (``runtime.placement.backend: ray``) on a two-node cluster on this
machine (``ray.cluster_utils.Cluster``: node B has a custom resource of its own). The placed
stage is our ordinary stage process, started by a launcher actor on node B: it is reached over
tcp with CURVE, gets and sends no shared-memory handle, and its death, its freezing and its
node's loss are each found within 2 s, after which it comes back where resources allow.
Run alone with ``pytest -m ray``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import pytest
import pytest_asyncio

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageStartupError
from tests.helpers import TTS_FACTORY, speak
from tests.stress.checks import after_shutdown
from tests.test_replicas import assert_same_speech

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.tts, pytest.mark.asyncio(loop_scope="session")]

TEXT = "Placement through Ray keeps the stage process our own, wherever it runs."
DETECT_WITHIN_S = 2.0
# Small object stores, no dashboard: these nodes carry control calls only.
NODE_ARGS = dict(num_cpus=2, object_store_memory=80 << 20)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(NODE_ARGS, resources={"node_a": 1}, include_dashboard=False))
    cluster.node_b = cluster.add_node(**NODE_ARGS, resources={"node_b": 1})
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def speech_config(address: str | None, **connectors) -> dict:
    """A speech stage on node B (by its resource), restarted when it dies; shared memory for
    every tensor it could use (threshold 0), so a handle would show if one were sent."""
    runtime = {"connectors": {"shm_threshold": 0, **connectors}}
    stage_runtime = {"max_batch_size": 2}
    if address is not None:
        runtime["placement"] = {"backend": "ray", "address": address}
        stage_runtime |= {"resources": {"node_b": 1}, "restart": "on-failure", "max_restarts": 5}
    return {"runtime": runtime, "stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
        "runtime": stage_runtime, "final_output": True, "final_output_type": "audio"}]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def placed(cluster):
    client = await MultiStageEngineClient.from_config(parse_pipeline_config(speech_config(cluster.address)))
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)
    assert not ray.is_initialized()  # the pipeline joined the cluster, so it left it too


@pytest.mark.llm
def test_serve_runs_unchanged_with_the_llm_and_speech_stages_placed_through_ray(cluster, tmp_path, smollm2_path):
    """``omni-engine serve`` on the speech pipeline with both stages placed through Ray (the LLM's
    vLLM in a process a launcher started, speech on node B): vLLM's OpenAI server answers.
    First in the module: its server runs while no pipeline of this process does."""
    import yaml

    from tests.serve_helpers import openai_client, running_server

    data = yaml.safe_load(open("stage_configs/smollm2_speech.yaml"))
    data["runtime"]["placement"] = {"backend": "ray", "address": cluster.address}
    llm, speech = data["stage_args"]
    del llm["runtime"]["devices"]
    llm["runtime"]["resources"] = {"node_a": 1, "CPU": 1}
    speech["runtime"]["resources"] = {"node_b": 1}
    config = tmp_path / "ray_speech.yaml"
    config.write_text(yaml.safe_dump(data))
    with running_server(str(config), "smollm2-ray", tmp_path) as server:
        answer = openai_client(server).chat.completions.create(
            model="smollm2-ray", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0.0)
        assert "Paris" in answer.choices[0].message.content
        log = server["log"].read_text()
        assert "joining the Ray cluster" in log and "stage 0: ready" in log and "stage 1: ready" in log


def replica(client):
    return client.stage_contexts[0].client.replicas[0]


async def wait_alive(client, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not client.replica_alive(0, 0):
            await asyncio.sleep(0.05)


async def seconds_until_evicted(client) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(10):
        while client.replica_alive(0, 0):
            await asyncio.sleep(0.01)
    return loop.time() - start


async def test_placed_stage_runs_on_its_node_over_tcp_and_curve_without_shared_memory(placed, cluster):
    await wait_alive(placed)
    stage = replica(placed)
    assert stage.ready.host_id == cluster.node_b.node_id != stage.host_id
    assert placed.replica_status(0)[0].host_id == cluster.node_b.node_id
    node_ip = placed.placement.node_ip
    for address in (stage.input_address, stage.output_address):
        assert address.startswith(f"tcp://{node_ip}:") and not address.startswith("tcp://0.0.0.0")
    # CURVE: only the stage's public key is admitted; its secret never came here.
    assert stage.curve.client is None and len(stage.curve.allowed_clients) == 1
    audio = await speak(placed, TEXT, "placed-0")
    assert (await stage.call_utility_async("shm_stats"))["bytes"] == 0
    assert all(d.foreign_host == cluster.node_b.node_id for d in stage._decoders.values())

    local = await MultiStageEngineClient.from_config(parse_pipeline_config(speech_config(None)))
    try:
        reference = await speak(local, TEXT, "local-0")
        # The same config on this host does use shared memory: the placed run's 0 bytes say something.
        assert (await replica(local).call_utility_async("shm_stats"))["bytes"] > 0
    finally:
        await local.shutdown_async()
    assert_same_speech(audio, reference)


async def test_killed_remote_stage_is_found_at_once_and_restarted_on_its_node(placed, cluster):
    await wait_alive(placed)
    old = replica(placed)
    os.kill(old.ready.pid, signal.SIGKILL)
    assert await seconds_until_evicted(placed) < DETECT_WITHIN_S
    await wait_alive(placed)
    new = replica(placed)
    assert new is not old and new.ready.host_id == cluster.node_b.node_id
    assert len(await speak(placed, TEXT, "after-kill")) > 0


async def test_frozen_remote_stage_is_found_by_missed_heartbeats(placed):
    """SIGSTOP: the process lives but says nothing, as behind a partition; only heartbeats tell."""
    await wait_alive(placed)
    old = replica(placed)
    os.kill(old.ready.pid, signal.SIGSTOP)
    try:
        assert await seconds_until_evicted(placed) < DETECT_WITHIN_S
        assert "heartbeats" in str(old.dead_error)
        await wait_alive(placed)
    finally:
        try:
            os.kill(old.ready.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert len(await speak(placed, TEXT, "after-freeze")) > 0
    assert not os.path.exists(f"/proc/{old.ready.pid}")  # the evicted replica was reaped, not left frozen


async def test_node_loss_is_found_and_the_stage_comes_back_where_resources_allow(placed, cluster):
    from omni_engine.placement.stage_launcher import LAUNCHER_DIR_PREFIX

    await wait_alive(placed)
    # What a launcher lost with its node leaves: its stage's socket directory, named after its
    # pid (that launcher itself may still be exiting when the next one starts: one whose pid
    # is surely gone stands in for it).
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"{LAUNCHER_DIR_PREFIX}{gone.pid}-"))
    cluster.remove_node(cluster.node_b)
    assert await seconds_until_evicted(placed) < DETECT_WITHIN_S
    # No node has node_b now; a new one that has it takes the stage.
    cluster.node_b = cluster.add_node(**NODE_ARGS, resources={"node_b": 1})
    await wait_alive(placed)
    assert replica(placed).ready.host_id == cluster.node_b.node_id
    assert len(await speak(placed, TEXT, "after-node-loss")) > 0
    assert not stale.exists()  # the new launcher (these nodes share /tmp) removed it first


async def test_generate_command_runs_unchanged_on_a_ray_config(cluster, tmp_path):
    """``omni-engine generate`` on a Ray config: a process of its own joins the cluster (the stage
    on node A this time: node B's resource is the module pipeline's)."""
    import yaml

    data = speech_config(cluster.address)
    data["stage_args"][0]["runtime"]["resources"] = {"node_a": 1}
    config = tmp_path / "ray_speech.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "omni_engine.entrypoints.cli.main", "generate", "--config", str(config),
        "--prompt", TEXT, "--output-dir", str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    async with asyncio.timeout(300):
        _, stderr = await proc.communicate()
    stderr = stderr.decode()
    assert proc.returncode == 0, stderr[-3000:]
    assert "joining the Ray cluster" in stderr and "stage 0: ready" in stderr
    with wave.open(str(tmp_path / "answer.wav")) as w:
        assert w.getframerate() == 22050 and w.getnframes() > 22050


async def test_a_stage_ray_cannot_place_fails_its_start_saying_what_is_missing(cluster, monkeypatch):
    """No node has ``node_c``: the start fails after the startup timeout, naming the stage, the
    resources and what the cluster has free, and leaves no placement group behind."""
    monkeypatch.setenv("OMNI_ENGINE_STAGE_STARTUP_TIMEOUT", "3")
    data = speech_config(cluster.address)
    data["stage_args"][0]["runtime"]["resources"] = {"node_c": 1}
    with pytest.raises(StageStartupError, match=r"stage 0 replica 0 was not placed within 3 s: Ray has not placed "
                                                r"replica bundles of \{'node_c': 1.0\} .*resources free in the "
                                                r"cluster: \{.*'node_a': 1.0"):
        await MultiStageEngineClient.from_config(parse_pipeline_config(data))
    from ray.util.placement_group import placement_group_table

    if ray.is_initialized():  # joined by the module's pipeline: the failed one's group is gone from it
        assert not [g for g in placement_group_table().values() if g["state"] != "REMOVED"
                    and g["bundles"] and "node_c" in g["bundles"][0]]
