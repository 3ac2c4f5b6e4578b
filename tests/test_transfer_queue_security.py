"""A transfer queue across hosts, without letting strangers in: the API key on HTTP, CURVE on
RPC, and no unprotected queue on a public address by accident. Real server processes."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
import zmq.auth

from omni_engine.transfer_queue import TransferQueueClient, TransferQueueError
from omni_engine.transfer_queue.security import API_KEY_ENV, client_curve_keys
from tests.tq_helpers import REPO, ServerProcess, trajectory

API_KEY = "tq-" + uuid.uuid4().hex
CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "transfer-queue", "serve"]
# Every route of the HTTP API but /health, with a body it would accept.
ROUTES = [
    ("POST", "/buffer/write", trajectory("evil-1", "x", reward=99.0)),
    ("POST", "/get_rollout_data", {}),
    ("POST", "/config", {"group_size": 1}),
    ("GET", "/config", None),
    ("POST", "/buffer/reset", None),
    ("GET", "/status", None),
    ("GET", "/metrics", None),
    ("DELETE", "/buffer/instance/math_1", None),
]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """server, client (shared by the clients), other (admitted by its public key), stranger (not admitted)."""
    directory = tmp_path_factory.mktemp("keys")
    for name in ("server", "client", "other", "stranger"):
        zmq.auth.create_certificates(directory, name)
    return directory


@pytest.fixture(scope="module")
def queue(keys, tmp_path_factory):
    data = tmp_path_factory.mktemp("tq")
    with ServerProcess("--group-size", "2", "--api-key", API_KEY,
                       "--curve-server-key", str(keys / "server.key_secret"),
                       "--curve-client-key", str(keys / "client.key_secret"),
                       "--curve-allowed-key", str(keys / "other.key"), data_dir=data) as proc:
        proc.data_dir = data
        yield proc


def admin(queue) -> httpx.Client:
    return httpx.Client(base_url=queue.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)


def rpc_client(queue, keys: Path, name: str | None, timeout: float = 30.0) -> TransferQueueClient:
    curve = client_curve_keys(keys / "server.key", keys / f"{name}.key_secret") if name else None
    return TransferQueueClient(rpc_address=queue.rpc, timeout=timeout, curve=curve)


def state(queue) -> dict:
    with admin(queue) as client:
        return {"status": client.get("/status").json(), "config": client.get("/config").json()}


def test_http_without_the_key_changes_nothing_and_with_it_works(queue, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with admin(queue) as client:
        client.post("/buffer/reset").raise_for_status()
        client.post("/buffer/write", json=trajectory(str(uuid.uuid4()), "math_1")).raise_for_status()
    before = state(queue)
    # Every near miss: no key, a wrong one, the key without "Bearer", one character more, the key
    # cut short by one character or to its first four, and a bare "Bearer" (HTTP strips the space after
    # it; a check of a prefix of the expected header passes all three).
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY},
                    {"authorization": f"Bearer {API_KEY}x"}, {"authorization": f"Bearer {API_KEY[:-1]}"},
                    {"authorization": f"Bearer {API_KEY[:4]}"}, {"authorization": "Bearer"}):
        with httpx.Client(base_url=queue.url, headers=headers, timeout=30) as stranger:
            for method, path, body in ROUTES:
                response = stranger.request(method, path, json=body)
                assert response.status_code == 401, (method, path, headers, response.text)
                answer = response.json()  # slime's shape
                assert answer["success"] is False and "unauthorized" in answer["message"], answer
                assert response.headers["www-authenticate"] == "Bearer"
            assert stranger.get("/health").status_code == 200  # a load balancer's check carries no key
    assert state(queue) == before
    # With the key (the client takes it from the environment, as vllm serve's clients do).
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    with TransferQueueClient(url=queue.url) as client:
        client.write(trajectory(str(uuid.uuid4()), "math_1"))
        groups = client.read().groups
    assert [len(g.trajectories) for g in groups] == [2]
    with admin(queue) as client:
        assert client.get("/metrics").status_code == 200
        assert client.delete("/buffer/instance/math_1").status_code == 200


def test_rpc_admits_only_admitted_keys_and_strangers_change_nothing(queue, keys):
    with admin(queue) as client:
        client.post("/buffer/reset").raise_for_status()
    with rpc_client(queue, keys, "client") as shared, rpc_client(queue, keys, "other") as other:
        shared.batch_write([trajectory(str(uuid.uuid4()), "math_2")])
        other.batch_write([trajectory(str(uuid.uuid4()), "math_2")])  # admitted by its public key file
        before = state(queue)
        assert before["status"]["total_trajectories"] == 2
        for name in ("stranger", None):  # another key, or no CURVE at all
            with rpc_client(queue, keys, name, timeout=1.0) as stranger:
                with pytest.raises(TransferQueueError, match="no reply"):
                    stranger.batch_write([trajectory(str(uuid.uuid4()), "math_2", reward=99.0)])
                with pytest.raises(TransferQueueError, match="no reply"):
                    stranger.read()
        assert state(queue) == before  # nothing written, nothing taken
        groups = shared.read().groups  # and the server still serves the admitted
    assert [len(g.trajectories) for g in groups] == [2]
    refusals = [line for line in queue.output().splitlines() if "refused a client from 127.0.0.1" in line]
    assert refusals, queue.output()[-2000:]
    assert len(refusals) == 1  # four refused attempts from one peer, logged once a minute


def test_no_secret_reaches_the_logs_the_routes_or_the_log_files(queue, keys):
    secrets = [API_KEY, *(zmq.auth.load_certificate(keys / f"{n}.key_secret")[1].decode()
                          for n in ("server", "client"))]
    with admin(queue) as client:
        shown = client.get("/config").text + client.get("/status").text + client.get("/metrics").text
    files = "".join(p.read_bytes().decode("latin-1") for p in Path(queue.data_dir).rglob("*") if p.is_file())
    for secret in secrets:
        assert secret not in queue.output() and secret not in shown and secret not in files


@pytest.mark.parametrize("flags, refused", [
    (["--host", "0.0.0.0"], ["the HTTP API would listen on 0.0.0.0 with no API key",
                             "the RPC API would listen on tcp://0.0.0.0:0 without CURVE"]),
    (["--host", "0.0.0.0", "--api-key", "k"], ["the RPC API would listen on tcp://0.0.0.0:0 without CURVE"]),
])
def test_a_public_address_without_protection_is_refused_unless_insecure(flags, refused):
    argv = [*CLI, "--port", "0", "--rpc-address", "tcp://0.0.0.0:0", "--log-level", "WARNING", *flags]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    for message in refused:
        assert message in result.stderr, result.stderr
    assert "--insecure" in result.stderr and "ready" not in result.stdout
    with ServerProcess("--host", "0.0.0.0", "--rpc-address", "tcp://0.0.0.0:0", *flags[2:], "--insecure") as proc:
        assert "INSECURE (--insecure)" in proc.output()
        for message in refused:
            assert message in proc.output()


def test_a_bad_key_file_is_named_before_starting(keys, tmp_path):
    for flags, message in [(["--curve-server-key", str(tmp_path / "none.key_secret")], "none.key_secret not found"),
                           (["--curve-server-key", str(keys / "server.key")], "has no secret key"),
                           (["--curve-client-key", str(keys / "client.key_secret")], "no server key")]:
        result = subprocess.run([*CLI, "--port", "0", "--rpc-address", "tcp://127.0.0.1:0", *flags], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stdout + result.stderr, (flags, result)


async def test_sample_publishes_to_a_protected_queue_over_http_and_rpc(queue, keys, tmp_path, text_server):
    """``omni-engine sample``'s transfer_queue section with the key (HTTP) and with CURVE keys (RPC)."""
    from omni_engine.sampling import make_sampler
    from omni_engine.sampling.config import load_sample_config
    from omni_engine.sampling.pipeline import Pipeline
    from tests.test_sampling import greedy, items, openai_fields, sample_config

    with admin(queue) as client:
        client.post("/buffer/reset").raise_for_status()
    (tmp_path / "keys").symlink_to(keys)
    sections = {"http": {"url": queue.url, "api_key_env": "SAMPLE_TQ_KEY"},
                "rpc": {"rpc_address": queue.rpc, "curve_server_key": "keys/server.key",
                        "curve_client_key": "keys/client.key_secret"}}
    written = 0
    for name, section in sections.items():
        config = sample_config(tmp_path, greedy("openai", **openai_fields(text_server), concurrency=2),
                               rows=items(2), sampling={"step_size": 1, "max_rollouts": 1, "max_steps": 1},
                               transfer_queue=section)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**config, "output": {"dir": name}}))
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SAMPLE_TQ_KEY", API_KEY)
            env.delenv(API_KEY_ENV, raising=False)
            sample = load_sample_config(path)
            summary = await Pipeline(sample, make_sampler(sample.sampler, sample.base_dir)).run()
        assert summary.published == 2, (name, summary)
        written += summary.published
    assert state(queue)["status"]["total_trajectories"] == written
    # A wrong key stops the run at its start, naming the queue and the refusal.
    from omni_engine.sampling.publish import PublishError

    config = sample_config(tmp_path, greedy("openai", **openai_fields(text_server)), rows=items(1),
                           sampling={"step_size": 1, "max_rollouts": 1, "max_steps": 1},
                           transfer_queue={"url": queue.url, "api_key": "wrong"})
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump({**config, "output": {"dir": "wrong"}}))
    sample = load_sample_config(tmp_path / "wrong.yaml")
    with pytest.raises(PublishError, match=rf"transfer_queue.url {queue.url}: .*HTTP 401"):
        await Pipeline(sample, make_sampler(sample.sampler, sample.base_dir)).run()
    assert state(queue)["status"]["total_trajectories"] == written
