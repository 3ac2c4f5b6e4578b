"""The transfer queue's key checks one by one (``omni_engine/transfer_queue/security.py``): the
bearer compare, which addresses count as exposed, key files, the refusal log and a real CURVE
handshake on loopback; the mutation run's selection for that module (docs/mutation.md).
tests/test_transfer_queue_security.py has the same rules through a served queue."""

from __future__ import annotations

import logging

import pytest
import zmq
import zmq.auth
from zmq.auth.base import Authenticator

from omni_engine.stage_engine.security import KeyFileError, KeyPair, load_public_key
from omni_engine.transfer_queue import security
from omni_engine.transfer_queue.security import (
    API_KEY_ENV,
    QueueSecurity,
    api_key_from_env,
    authorized,
    client_curve_keys,
    secure_rpc_client,
    secure_rpc_server,
)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("tq_unit_keys")
    for name in ("server", "client", "other", "stranger"):
        zmq.auth.create_certificates(str(d), name)
    return d


def test_the_api_key_comes_from_the_environment_when_set_and_non_empty(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_from_env() is None
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key_from_env() is None
    monkeypatch.setenv(API_KEY_ENV, "k1")
    assert api_key_from_env() == "k1"


@pytest.mark.parametrize("header, ok", [
    (b"Bearer k1", True),
    (None, False),
    (b"Bearer k2", False),
    (b"bearer k1", False),
    (b"Bearer k1 ", False),
    (b"k1", False),
    (b"", False),
])
def test_authorized_only_for_the_exact_bearer_header(header, ok):
    assert authorized(header, "k1") is ok


def test_open_paths_are_health_and_metrics_only_when_public():
    assert QueueSecurity().open_paths() == {"/health"}
    assert QueueSecurity(public_metrics=True).open_paths() == {"/health", "/metrics"}


def test_from_files_defaults_to_private_metrics_and_secure():
    sec = QueueSecurity.from_files()
    assert (sec.api_key, sec.curve, sec.public_metrics, sec.insecure) == (None, None, False, False)


def test_no_key_files_means_no_curve(keys):
    sec = QueueSecurity.from_files(api_key="k", public_metrics=True, insecure=True)
    assert (sec.api_key, sec.curve, sec.public_metrics, sec.insecure) == ("k", None, True, True)
    assert "k" not in repr(sec)


def test_a_shared_client_keypair_is_admitted_and_fixed(keys):
    sec = QueueSecurity.from_files(server_key=str(keys / "server.key_secret"),
                                   client_key=str(keys / "client.key_secret"))
    client = KeyPair.load(keys / "client.key_secret")
    assert sec.curve.server == KeyPair.load(keys / "server.key_secret")
    assert sec.curve.client == client and sec.curve.fixed_client
    assert sec.curve.allowed_clients == {client.public}


def test_allowed_public_keys_alone_are_admitted(keys):
    sec = QueueSecurity.from_files(server_key=str(keys / "server.key_secret"),
                                   allowed_keys=(str(keys / "other.key"), str(keys / "client.key")))
    assert sec.curve.client is None and not sec.curve.fixed_client
    assert sec.curve.allowed_clients == {load_public_key(keys / "other.key"), load_public_key(keys / "client.key")}
    both = QueueSecurity.from_files(server_key=str(keys / "server.key_secret"), client_key=str(keys / "client.key_secret"),
                                    allowed_keys=(str(keys / "other.key"),))
    assert both.curve.allowed_clients == {load_public_key(keys / "other.key"), load_public_key(keys / "client.key")}


def test_key_files_that_admit_nobody_or_lack_the_server_are_refused(keys):
    with pytest.raises(KeyFileError, match="admits no client"):
        QueueSecurity.from_files(server_key=str(keys / "server.key_secret"))
    with pytest.raises(KeyFileError, match="no server key"):
        QueueSecurity.from_files(client_key=str(keys / "client.key_secret"))
    with pytest.raises(KeyFileError, match="no server key"):
        QueueSecurity.from_files(allowed_keys=(str(keys / "client.key"),))


@pytest.mark.parametrize("host, rpc, exposed", [
    ("127.0.0.1", None, []),
    ("localhost", "tcp://127.0.0.1:5555", []),
    ("::1", "tcp://[::1]:5555", []),
    ("127.0.0.1", "ipc:///tmp/q.sock", []),
    ("127.0.0.1", "inproc://q", []),
    ("0.0.0.0", None, ["HTTP"]),
    ("10.1.2.3", "tcp://10.1.2.3:5555", ["HTTP", "RPC"]),
    ("127.0.0.1", "tcp://*:5555", ["RPC"]),
    ("127.0.0.1", "tcp://:5555", ["RPC"]),
    ("127.0.0.1", "tcp://[::]:5555", ["RPC"]),
])
def test_exposure_is_a_public_address_without_its_protection(host, rpc, exposed):
    problems = QueueSecurity().exposure_problems(host, rpc)
    assert [p.split(" API")[0].removeprefix("the ") for p in problems] == exposed
    if "HTTP" in exposed:
        assert f"listen on {host} with no API key" in problems[0] and API_KEY_ENV in problems[0]
    if "RPC" in exposed:
        assert f"listen on {rpc} without CURVE" in problems[-1]


def test_protection_removes_the_exposure(keys):
    sec = QueueSecurity.from_files(api_key="k", server_key=str(keys / "server.key_secret"),
                                   client_key=str(keys / "client.key_secret"))
    assert sec.exposure_problems("0.0.0.0", "tcp://0.0.0.0:5555") == []


def test_refusals_are_logged_once_an_interval_per_peer_with_the_count_between(monkeypatch, caplog):
    clock = [1000.0]
    monkeypatch.setattr(security.time, "monotonic", lambda: clock[0])
    log = security._RefusalLog(interval=60.0)
    caplog.set_level(logging.WARNING, logger=security.logger.name)
    log.refused("10.0.0.1")
    log.refused("10.0.0.1")
    log.refused("10.0.0.1")
    log.refused("10.0.0.2")
    clock[0] += 59.9
    log.refused("10.0.0.1")
    clock[0] += 0.1
    log.refused("10.0.0.1")
    clock[0] += 60.0
    log.refused("10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert "from 10.0.0.1" in lines[0] and lines[0].endswith("its CURVE key is not admitted")
    assert "from 10.0.0.2" in lines[1]
    assert lines[2].endswith("(3 more refusals since the last report)")
    assert "more refusals" not in lines[3]


def test_a_refusal_right_at_start_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(security.time, "monotonic", lambda: 0.0)  # a fresh host's clock
    caplog.set_level(logging.WARNING, logger=security.logger.name)
    security._RefusalLog(interval=60.0).refused("10.0.0.9")
    assert len(caplog.records) == 1


async def test_the_authenticator_admits_its_keys_and_logs_the_peer_it_refuses(monkeypatch, caplog):
    async def handled(self, msg):
        return None

    monkeypatch.setattr(Authenticator, "handle_zap_message", handled)
    ctx = zmq.Context()
    try:
        auth = security._QueueAuthenticator(ctx, frozenset({b"A" * 40}))
        caplog.set_level(logging.WARNING, logger=security.logger.name)
        auth.callback("omni_engine", b"B" * 40)  # before any ZAP request: the peer is unknown
        assert "from ?:" in caplog.records[-1].getMessage()
        caplog.clear()
        auth.refusals = security._RefusalLog()
        await auth.handle_zap_message([b"1.0", b"1", b"omni_engine", b"10.9.8.7", b"", b"CURVE", b"B" * 32])
        assert auth.callback("omni_engine", b"A" * 40) is True
        assert not caplog.records
        assert auth.callback("omni_engine", b"B" * 40) is False
        assert "from 10.9.8.7" in caplog.records[-1].getMessage()
        await auth.handle_zap_message([b"1.0", b"1", b"omni_engine", b"\xff10.0.0.1"])  # not UTF-8: shown anyway
        auth.refusals = security._RefusalLog()
        auth.callback("omni_engine", b"B" * 40)
        assert "from \ufffd10.0.0.1" in caplog.records[-1].getMessage()
        await auth.handle_zap_message([b"1.0", b"1", b"omni_engine"])
        auth.refusals = security._RefusalLog()
        auth.callback("omni_engine", b"B" * 40)
        assert "from ?:" in caplog.records[-1].getMessage()
    finally:
        ctx.term()


def test_client_curve_keys_are_the_clients_pair_and_the_servers_public_key(keys):
    got = client_curve_keys(keys / "server.key", keys / "client.key_secret")
    assert got.keypair == KeyPair.load(keys / "client.key_secret")
    assert got.server_public == load_public_key(keys / "server.key")


def _round_trip(ctx: zmq.Context, address: str, client_keys, wait_ms: int) -> bytes | None:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    secure_rpc_client(sock, client_keys)
    sock.connect(address)
    try:
        sock.send(b"ping")
        return sock.recv() if sock.poll(wait_ms) else None
    finally:
        sock.close()


def test_a_curve_server_answers_admitted_clients_only(keys):
    sec = QueueSecurity.from_files(server_key=str(keys / "server.key_secret"),
                                   allowed_keys=(str(keys / "client.key"),))
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    auth = secure_rpc_server(ctx, server, sec.curve)
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"

        def serve_one(wait_ms=2000):
            if server.poll(wait_ms):
                ident, msg = server.recv_multipart()
                server.send_multipart([ident, b"pong:" + msg])

        import threading

        thread = threading.Thread(target=serve_one)
        thread.start()
        assert _round_trip(ctx, address, client_curve_keys(keys / "server.key", keys / "client.key_secret"),
                           2000) == b"pong:ping"
        thread.join()
        thread = threading.Thread(target=serve_one, args=(700,))
        thread.start()
        assert _round_trip(ctx, address, client_curve_keys(keys / "server.key", keys / "stranger.key_secret"), 300) is None
        assert _round_trip(ctx, address, None, 300) is None  # no CURVE at all
        thread.join()
    finally:
        server.close()
        auth.stop()
        ctx.term()
