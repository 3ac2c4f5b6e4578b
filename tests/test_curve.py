"""Authenticated TCP: loopback by default, ZMQ CURVE with a ZAP allowlist, key files in the config.

Real stage processes and real sockets: a pipeline whose stage is reached over
tcp with CURVE on serves requests, while peers without an allowed client key
(none at all, or a wrong one that knows the server's public key) can neither
inject messages nor read anything, and a stage holding the wrong keys fails
``start()`` with an error naming CURVE.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import textwrap
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from omni_engine.config import ConfigError, load_pipeline_config
from omni_engine.connectors.shm import new_run_prefix, stage_prefix
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageStartupError
from omni_engine.wire.protocol import StageDead, StageReady, StageResponseType, StageUtilityResult
from omni_engine.stage_engine.security import CurveKeys, KeyPair, StageCurveKeys, make_client
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_sockets import make_addresses
from tests.helpers import tts_spec

# (async tests run on the session loop: asyncio_default_test_loop_scope in pyproject.toml)

TTS_FACTORY = "omni_engine.engines.tts:make_espeak_tts"
PIPELINE = f"""\
runtime:
  security: {{curve: true, server_key: keys/server.key_secret, client_key: keys/client.key_secret}}
stage_args:
  - stage_id: 0
    stage_type: generation
    runtime: {{transport: tcp}}
    engine_args: {{model_factory: "{TTS_FACTORY}"}}
    final_output: true
    final_output_type: audio
"""
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def write_pipeline(root: Path, text: str = PIPELINE) -> Path:
    (root / "keys").mkdir(exist_ok=True)
    for name in ("server", "client"):
        if not (root / "keys" / f"{name}.key_secret").exists():
            _, secret = zmq.auth.create_certificates(root / "keys", name)
            os.chmod(secret, 0o600)
    path = root / "pipe.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def curve_pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    client = await MultiStageEngineClient.from_config(load_pipeline_config(write_pipeline(root)))
    yield client, root / "keys"
    await client.shutdown_async()


async def _speak(pipeline: MultiStageEngineClient, request_id: str) -> None:
    outputs = [o async for o in pipeline.generate("Only friends get in.", None, request_id)]
    audio = outputs[-1].multimodal_output["audio"]
    assert outputs[-1].finished and outputs[-1].multimodal_output["sample_rate"] == 22050 and len(audio) > 5000


async def test_curve_stage_over_tcp_serves_and_binds_loopback(curve_pipeline):
    pipeline, _ = curve_pipeline
    stage = pipeline.stage_contexts[0].client.replicas[0]
    assert stage.curve is not None
    assert stage.input_address.startswith("tcp://127.0.0.1:") and stage.output_address.startswith("tcp://127.0.0.1:")
    await _speak(pipeline, "curve-1")


# The strangers' own context: not Context.instance(), which other test modules use too.
_STRANGERS = zmq.Context()
# Monitor endpoints of our own: pyzmq names one after the socket's descriptor number, which a
# socket opened right after another closed reuses while libzmq may still hold the old endpoint
# ("Address already in use").
_MONITORS = itertools.count()


def _stranger(kind: int, address: str, keys: StageCurveKeys | None) -> tuple[zmq.Socket, zmq.Socket]:
    sock = _STRANGERS.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, keys)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_FAILED),
                                      addr=f"inproc://stranger-monitor-{next(_MONITORS)}")
    sock.connect(address)
    return sock, monitor


def _send_if_possible(sock: zmq.Socket, frames: list[bytes]) -> None:
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:  # no pipe at all: nothing can leave either
        pass


def _handshake_result(monitor: zmq.Socket, timeout: float = 5.0) -> int | None:
    """The first handshake event on ``monitor`` (None: none within ``timeout``)."""
    if not monitor.poll(timeout * 1000):
        return None
    return recv_monitor_message(monitor)["event"]


async def test_peers_without_an_allowed_key_can_neither_inject_nor_read(curve_pipeline):
    pipeline, keys_dir = curve_pipeline
    stage = pipeline.stage_contexts[0].client.replicas[0]
    server_public, _ = zmq.auth.load_certificate(keys_dir / "server.key")
    allowed = KeyPair(*zmq.auth.load_certificate(keys_dir / "client.key_secret"))
    dead = [StageResponseType.DEAD.value, msgspec.msgpack.encode(StageDead("forged: stage is gone"))]
    ready = [StageResponseType.READY.value, msgspec.msgpack.encode(StageReady(0, 1, stage.shm_prefix, {}))]
    strangers = {"no keys": None, "wrong client key": StageCurveKeys(KeyPair.generate(), server_public)}
    received = stage.bytes_received
    for name, keys in strangers.items():
        push, push_monitor = _stranger(zmq.PUSH, stage.output_address, keys)
        dealer, dealer_monitor = _stranger(zmq.DEALER, stage.input_address, keys)
        try:
            # Queued at once (a connecting socket has its pipe before the handshake);
            # without CURVE the forged DEAD would end the stage for the client.
            _send_if_possible(push, dead)
            _send_if_possible(dealer, ready)
            for monitor in (push_monitor, dealer_monitor):
                event = await asyncio.to_thread(_handshake_result, monitor)
                assert event in _FAILED, f"{name}: handshake {event} instead of a refusal"
            assert not await asyncio.to_thread(dealer.poll, 300), f"{name}: the stranger received something"
        finally:
            for sock in (push, push_monitor, dealer, dealer_monitor):
                sock.close(linger=0)
    assert stage.bytes_received == received and not stage.is_dead
    # Control: the allowed key gets through the same door.
    push, monitor = _stranger(zmq.PUSH, stage.output_address, StageCurveKeys(allowed, server_public))
    try:
        assert await asyncio.to_thread(_handshake_result, monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        push.send_multipart([StageResponseType.UTILITY_RESULT.value,
                             msgspec.msgpack.encode(StageUtilityResult(10**12))])
        async with asyncio.timeout(5):
            while stage.bytes_received == received:
                await asyncio.sleep(0.01)
    finally:
        push.close(linger=0)
        monitor.close(linger=0)
    assert not stage.is_dead
    await _speak(pipeline, "curve-2")


def _handshake_with(address: str, keys: StageCurveKeys, kind: int = zmq.PUSH, timeout: float = 5.0) -> int | None:
    """Connect to ``address`` holding ``keys``, send nothing, and say how the handshake ended."""
    sock, monitor = _stranger(kind, address, keys)
    try:
        return _handshake_result(monitor, timeout)
    finally:
        sock.close(linger=0)
        monitor.close(linger=0)


REPLICAS = PIPELINE.replace(", server_key: keys/server.key_secret, client_key: keys/client.key_secret", "").replace(
    "runtime: {transport: tcp}", "runtime: {transport: tcp, num_replicas: 2, restart: on-failure}")


async def test_an_evicted_replicas_key_is_admitted_nowhere(tmp_path):
    """Every replica process gets a keypair of its own, so once one is evicted (killed, then
    restarted), a zombie still holding its key gets through neither its successor's door nor
    the other replica's, while the live replicas' own keys still do."""
    client = await MultiStageEngineClient.from_config(load_pipeline_config(write_pipeline(tmp_path, REPLICAS)))
    try:
        stage = client.stage_contexts[0].client
        victim, other = stage.replicas
        server_public = victim.curve.server.public
        evicted = StageCurveKeys(victim.curve.client, server_public)
        assert victim.curve.client.public != other.curve.client.public
        # Control: the key opens its own replica's door while that replica lives.
        assert await asyncio.to_thread(_handshake_with, victim.output_address, evicted) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        os.kill(victim.ready.pid, signal.SIGKILL)
        async with asyncio.timeout(60):
            while stage.replicas[0] is victim or not client.replica_status(0)[0].alive:
                await asyncio.sleep(0.05)
        successor = stage.replicas[0]
        assert successor.curve.client.public not in (victim.curve.client.public, other.curve.client.public)
        for door, kind in ((successor.output_address, zmq.PUSH), (successor.input_address, zmq.DEALER),
                           (other.output_address, zmq.PUSH), (other.input_address, zmq.DEALER)):
            event = await asyncio.to_thread(_handshake_with, door, evicted, kind)
            assert event in _FAILED, f"{door}: handshake {event} with the evicted replica's key"
        # The evicted replica's own door closed with its client (nothing answers, or a new socket on its port refuses).
        assert await asyncio.to_thread(_handshake_with, victim.output_address, evicted, zmq.PUSH, 1.0) \
            != zmq.EVENT_HANDSHAKE_SUCCEEDED
        for live in (successor, other):  # control: each live replica's key opens its door
            keys = StageCurveKeys(live.curve.client, server_public)
            assert await asyncio.to_thread(_handshake_with, live.output_address, keys) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        for i in range(2):
            await _speak(client, f"after-eviction-{i}")
    finally:
        await client.shutdown_async()


async def test_stage_with_wrong_keys_fails_start_naming_curve():
    keys = CurveKeys.generate()
    wrong = {
        "refused client key": StageCurveKeys(KeyPair.generate(), keys.server.public),
        "wrong server key": StageCurveKeys(keys.client, KeyPair.generate().public),
    }
    clients = [StageEngineCoreClient(20 + i, process=tts_spec().replace(curve=stage_keys),
                                     transport="tcp", curve=keys, startup_timeout=120)
               for i, stage_keys in enumerate(wrong.values())]
    results = await asyncio.gather(*(c.start() for c in clients), return_exceptions=True)
    for (name, _), result in zip(wrong.items(), results):
        assert isinstance(result, StageStartupError), (name, result)
        message = str(result)
        # The stage's own handshake check ends it at once: an exit, not a startup timeout.
        assert "exited with code 1 during startup" in message and "CURVE" in message, (name, message)
    assert "refused this stage's key" in str(results[0]) and "wrong server public key" in str(results[1])


async def test_unauthenticated_ready_cannot_take_over_startup():
    """A stranger that connects first and sends a READY becomes 'the stage' without CURVE;
    with CURVE it is refused at the handshake and the startup times out instead."""
    hostile_ready = [StageResponseType.READY.value,
                     msgspec.msgpack.encode(StageReady(30, os.getpid(), stage_prefix(new_run_prefix(), 30), {}))]
    keys = CurveKeys.generate()
    for curve in (None, keys):
        client = StageEngineCoreClient(30, transport="tcp", curve=curve, startup_timeout=1.5)
        starting = asyncio.create_task(client.start())
        while client.input_address is None or client.input_address.endswith(":*"):
            await asyncio.sleep(0.01)
        strangers = [_stranger(zmq.DEALER, client.input_address, None),
                     _stranger(zmq.DEALER, client.input_address, StageCurveKeys(KeyPair.generate(), keys.server.public))]
        try:
            for dealer, _ in strangers:
                _send_if_possible(dealer, hostile_ready)
            if curve is None:
                await starting  # the attack works without CURVE: the stranger's READY is taken
                assert client.ready.pid == os.getpid()
            else:
                with pytest.raises(StageStartupError, match="did not become ready within 1.5 s.*CURVE"):
                    await starting
        finally:
            for dealer, monitor in strangers:
                dealer.close(linger=0)
                monitor.close(linger=0)
            await client.shutdown()


# ----------------------------------------------------------------- addresses
def test_tcp_binds_loopback_unless_a_host_is_given():
    assert make_addresses(0, "tcp", Path("/x")) == ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    assert make_addresses(0, "tcp", Path("/x"), "0.0.0.0")[0] == "tcp://0.0.0.0:*"
    assert make_addresses(0, "tcp", Path("/x"), "::1")[0] == "tcp://[::1]:*"
    assert make_addresses(0, "ipc", Path("/x")) == ("ipc:///x/in", "ipc:///x/out")
    with pytest.raises(ValueError, match="stage 4: 'example.com' is not an IP address"):
        StageEngineCoreClient(4, transport="tcp", host="example.com")
    with pytest.raises(ValueError, match="stage 4: a host .* applies only to transport 'tcp'"):
        StageEngineCoreClient(4, transport="ipc", host="127.0.0.1")


async def test_ipv6_loopback_host_binds_and_serves():
    client = StageEngineCoreClient(31, process=tts_spec(), transport="tcp", host="::1")
    try:
        await client.start()
        assert client.input_address.startswith("tcp://[::1]:")
        await client.submit_request("v6", "Six.", None)
        output = await asyncio.wait_for(client.get_output_async(), 60)
        assert output.finished and len(output.multimodal_output["audio"]) > 0
    finally:
        await client.shutdown()


# -------------------------------------------------------------------- config
def _errors(tmp_path: Path, security: str) -> list[str]:
    path = write_pipeline(tmp_path, PIPELINE.replace(
        "  security: {curve: true, server_key: keys/server.key_secret, client_key: keys/client.key_secret}",
        f"  security: {security}"))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    for error in info.value.errors:
        assert error.startswith(f"{path}: "), error
    return info.value.errors


def test_key_files_are_resolved_next_to_the_config_and_loaded(tmp_path):
    config = load_pipeline_config(write_pipeline(tmp_path))
    security = config.runtime.security
    assert security.server_key == str(tmp_path / "keys" / "server.key_secret")
    keys = security.curve_keys()
    public, secret = zmq.auth.load_certificate(tmp_path / "keys" / "client.key_secret")
    assert keys.client == KeyPair(public, secret) and keys.allowed_clients == {public}
    assert repr(secret) not in repr(keys) and repr(secret) not in repr(keys.for_stage())


def test_curve_without_key_files_generates_keys_per_run(tmp_path):
    path = write_pipeline(tmp_path, PIPELINE.replace(
        ", server_key: keys/server.key_secret, client_key: keys/client.key_secret", ""))
    security = load_pipeline_config(path).runtime.security
    first, second = security.curve_keys(), security.curve_keys()
    assert first.server.public != second.server.public and first.client.public != second.client.public


@pytest.mark.parametrize("security, field, needle", [
    ("{curve: true, server_key: keys/missing.key_secret}", "server_key", "missing.key_secret not found"),
    ("{curve: true, client_key: keys/client.key}", "client_key", "has no secret key"),
    ("{curve: true, client_key: pipe.yaml}", "client_key", "is not a ZMQ certificate"),
    ("{curve: false, server_key: keys/server.key_secret}", "server_key", "curve is false"),
])
def test_bad_key_config_names_field_and_file(tmp_path, security, field, needle):
    (error,) = _errors(tmp_path, security)
    assert f"runtime.security.{field}: " in error and needle in error, error


def test_key_file_gone_after_validation_is_a_config_error(tmp_path):
    config = load_pipeline_config(write_pipeline(tmp_path))
    (tmp_path / "keys" / "client.key_secret").unlink()
    with pytest.raises(ConfigError, match=r"runtime.security.client_key: key file .*client.key_secret not found"):
        config.runtime.security.curve_keys()


@pytest.mark.parametrize("runtime, needle", [
    ("{transport: ipc, host: 127.0.0.1}", "host '127.0.0.1' applies only to transport: tcp"),
    ("{transport: tcp, host: my-laptop}", "'my-laptop' is not an IP address"),
])
def test_bad_host_is_a_config_error(tmp_path, runtime, needle):
    path = write_pipeline(tmp_path, PIPELINE.replace("runtime: {transport: tcp}", f"runtime: {runtime}"))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    (error,) = info.value.errors
    assert "stage 0: stage_args[0].runtime.host: " in error and needle in error, error


def test_host_defaults_to_none_meaning_loopback(tmp_path):
    stage = load_pipeline_config(write_pipeline(tmp_path)).stage_args[0]
    assert stage.runtime.transport == "tcp" and stage.runtime.host is None

