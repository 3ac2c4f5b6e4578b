"""``omni-engine serve``: the text pipeline behind vLLM's OpenAI server, used with the official client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import psutil
import pytest

from tests.helpers import process_exists

pytestmark = pytest.mark.llm

CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]
MODEL = "smollm2-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _log_tail(path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CLI, "serve", "stage_configs/smollm2_text.yaml", "--port", str(port), "--served-model-name", MODEL],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    descendants: set[int] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                pytest.fail(f"omni-engine serve exited with {proc.returncode}:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"omni-engine serve not healthy after {START_TIMEOUT_S} s:\n{_log_tail(log)}")
            time.sleep(1)
        descendants = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        yield {"url": url, "proc": proc, "log": log}
    finally:
        # A graceful stop first (SIGTERM, as a supervisor sends it), then the whole group.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            returncode = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait(10)
        deadline = time.monotonic() + 15
        while (left := [pid for pid in descendants if process_exists(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing may be left in the group either
        except ProcessLookupError:
            pass
        assert not left, f"processes left after the server stopped: {left}\n{_log_tail(log)}"
        assert returncode == 0, f"omni-engine serve exited with {returncode} on SIGTERM:\n{_log_tail(log)}"
        assert "stage 0: ready" in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 2048


def test_chat_completion_answers(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0


def test_streaming_chat_completion_streams_the_answer(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 3, pieces  # token by token, not one final blob
    assert "Paris" in "".join(pieces)


def test_completion_answers(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                         max_tokens=8)
    assert "Paris" in response.choices[0].text


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=8)
    assert "no-such-model" in str(unknown.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=-1)
    assert "max_tokens" in str(bad.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=8)
    with pytest.raises(openai.BadRequestError) as too_long:  # checked before any stage sees it
        client.completions.create(model=MODEL, prompt="hello " * 3000, max_tokens=4)
    assert "context length" in str(too_long.value)
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in response.choices[0].message.content
