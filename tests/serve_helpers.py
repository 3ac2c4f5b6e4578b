"""Running ``omni-engine serve`` as a subprocess for tests, as a supervisor would."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import process_exists

CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET ``url`` (None: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def log_tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def running_server(config: str, model: str, log_dir: Path, extra_args: tuple[str, ...] = (),
                   api_key: str | None = None, env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """``omni-engine serve`` in its own session until healthy; on exit SIGTERM, then
    assert it exited 0 and left no process behind. ``extra_args`` are more serve flags;
    ``api_key`` is passed as ``--api-key`` and kept in the returned dict for clients."""
    if api_key is not None:
        extra_args = (*extra_args, "--api-key", api_key)
    port = free_port()
    log = log_dir / "server.log"
    with open(log, "wb") as out:
        # Inherits OMNI_ENGINE_CACHE (the prepared model) from this environment.
        proc = subprocess.Popen(
            [*CLI, "serve", config, "--port", str(port), "--served-model-name", model, *extra_args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    descendants: set[int] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_status(f"{url}/health") != 200:
            if proc.poll() is not None:
                pytest.fail(f"omni-engine serve exited with {proc.returncode}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"omni-engine serve not healthy after {START_TIMEOUT_S} s:\n{log_tail(log)}")
            time.sleep(1)
        descendants = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        yield {"url": url, "proc": proc, "log": log, "api_key": api_key}
    finally:
        _stop(proc, descendants, log)


def _stop(proc: subprocess.Popen, descendants: set[int], log: Path) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # graceful, as a supervisor stops it
    try:
        returncode = proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait(10)
    deadline = time.monotonic() + 15
    while (left := [pid for pid in descendants if process_exists(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # nothing may be left in the group either
    assert not left, f"processes left after the server stopped: {left}\n{log_tail(log)}"
    assert returncode == 0, f"omni-engine serve exited with {returncode} on SIGTERM:\n{log_tail(log)}"
    assert "stage 0: ready" in log.read_text(errors="replace")


def openai_client(server: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server.get("api_key") or "unused",
                         timeout=120, max_retries=0)


def auth_headers(server: dict[str, Any]) -> dict[str, str]:
    """The bearer header a request to ``server`` needs (none without ``--api-key``)."""
    key = server.get("api_key")
    return {"Authorization": f"Bearer {key}"} if key else {}


def scrape(url: str, prefix: str = "omni_engine_") -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of the series on /metrics whose name starts with ``prefix``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def value(samples, name: str, **labels: str) -> float:
    """The one sample of ``name`` with these labels (``le`` too for buckets)."""
    hits = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == w for k, w in labels.items())
            and ("le" in labels or "le" not in lbl)]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples in {samples.get(name)}"
    return hits[0]


def assert_nothing_in_flight(server: dict[str, Any], wait_s: float = 10.0) -> None:
    """No stage of ``server`` holds a request (its /metrics say so), waiting up to ``wait_s`` for aborts to land."""
    deadline = time.monotonic() + wait_s
    while True:
        busy = [(labels, v) for labels, v in scrape(server["url"]).get("omni_engine_replica_requests_in_flight", [])
                if v]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not busy, f"requests still in flight on stages: {busy}"


def audio_chat(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[str, Any, int]:
    """A chat with ``modalities: ["text", "audio"]`` and ``audio.format: pcm16`` (``body``, ``model``
    included): its text, its waveform (float32), and how many audio pieces it came in; streamed
    (``body["stream"]``: the deltas joined) or whole (the transcript checked against the text)."""
    import base64
    import json

    import httpx
    import numpy as np

    def pcm16(data: str) -> np.ndarray:
        return np.frombuffer(base64.b64decode(data), dtype="<i2").astype(np.float32) / 32768

    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message["audio"]["transcript"] == message["content"]
        return message["content"], pcm16(message["audio"]["data"]), 1
    text, chunks = "", []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            delta = event["choices"][0]["delta"] if event["choices"] else {}
            text += delta.get("content") or ""
            if "data" in (delta.get("audio") or {}):
                chunks.append(pcm16(delta["audio"]["data"]))
    return text, np.concatenate(chunks) if chunks else np.zeros(0, np.float32), len(chunks)
