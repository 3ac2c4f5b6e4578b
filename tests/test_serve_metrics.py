"""``omni-engine serve`` of the speech pipeline: Prometheus metrics on ``/metrics``, and ``/health``
when a stage process is killed. Everything goes through HTTP, as a scraper and a supervisor see it."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import openai
import psutil
import pytest

from tests.serve_helpers import http_status, log_tail, openai_client, running_server, scrape, value

pytestmark = pytest.mark.llm

CONFIG = "stage_configs/smollm2_speech.yaml"
MODEL = "smollm2-speech-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# Every family the exporter defines (sample names as exposed).
STAGE_GAUGES = ["omni_engine_stage_up", "omni_engine_stage_requests_waiting", "omni_engine_stage_requests_running"]
STAGE_COUNTERS = [f"omni_engine_stage_{n}_total" for n in (
    "requests", "requests_finished", "requests_failed", "requests_aborted", "outputs", "bytes_in", "bytes_out")]
STAGE_HISTOGRAMS = ["omni_engine_stage_queue_time_seconds", "omni_engine_stage_run_time_seconds"]
EDGE_HISTOGRAM = "omni_engine_edge_transfer_seconds"
EDGE_BYTES = "omni_engine_edge_transfer_bytes_total"
E2E = "omni_engine_request_e2e_seconds"
TTFO = "omni_engine_request_time_to_first_output_seconds"
REQUESTS = "omni_engine_requests_total"
ERRORS = "omni_engine_stage_errors_total"


def _stage_pids(log) -> dict[int, int]:
    """Stage id -> pid, from the server's "stage N: ready in X s (pid P)" lines."""
    found = re.findall(r"stage (\d+): ready in [\d.]+ s \(pid (\d+)\)", log.read_text(errors="replace"))
    return {int(sid): int(pid) for sid, pid in found}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    with running_server(CONFIG, MODEL, tmp_path_factory.mktemp("serve_metrics")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def after_chats(server, client):
    """Two chat requests (one streamed), then a scrape."""
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in response.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return scrape(server["url"])


def test_chat_requests_move_the_stage_and_request_metrics(after_chats):
    m = after_chats
    for name in ("requests", "requests_finished", "outputs", "bytes_in", "bytes_out"):
        assert value(m, f"omni_engine_stage_{name}_total", stage="0") >= (2 if "requests" in name else 1), name
    assert value(m, "omni_engine_stage_requests_failed_total", stage="0") == 0
    for name in STAGE_HISTOGRAMS:
        assert value(m, f"{name}_count", stage="0") >= 2, name
        assert value(m, f"{name}_sum", stage="0") > 0, name
        assert value(m, f"{name}_bucket", stage="0", le="+Inf") == value(m, f"{name}_count", stage="0")
    # Text-only chat ends at the text stage: its e2e and TTFO.
    assert value(m, f"{E2E}_count", final_stages="0") >= 2
    assert value(m, f"{E2E}_sum", final_stages="0") > 0
    assert value(m, f"{TTFO}_count", stage="0") >= 2
    assert 0 < value(m, f"{TTFO}_sum", stage="0") <= value(m, f"{E2E}_sum", final_stages="0")
    assert value(m, REQUESTS, outcome="finished") >= 2
    assert value(m, "omni_engine_stage_up", stage="0") == 1
    assert value(m, "omni_engine_stage_up", stage="1") == 1
    assert value(m, "omni_engine_stage_requests_waiting", stage="0") == 0
    assert value(m, "omni_engine_stage_requests_running", stage="0") == 0


def test_every_family_is_exported_for_every_stage_and_edge(after_chats):
    m = after_chats
    for name in STAGE_GAUGES + STAGE_COUNTERS:
        for stage in ("0", "1"):
            value(m, name, stage=stage)
    for name in STAGE_HISTOGRAMS:
        for stage in ("0", "1"):
            value(m, f"{name}_count", stage=stage)
    # The speech stage and the 0 -> 1 edge exist (at zero) before any request reaches stage 1;
    # test_a_spoken_answer_moves_the_speech_stage_and_edge_metrics makes them move.
    value(m, f"{EDGE_HISTOGRAM}_count", src="0", dst="1")
    value(m, EDGE_BYTES, src="0", dst="1")
    value(m, f"{TTFO}_count", stage="1")
    for outcome in ("finished", "failed", "aborted"):
        value(m, REQUESTS, outcome=outcome)


def long_stream(client, chunks: int):
    """A streamed chat that runs for a long while (ignore_eos), after its first ``chunks`` text chunks."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        temperature=0, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    read = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            read += 1
            if read >= chunks:
                break
    return stream, read


def test_gauges_and_aborts_follow_a_streamed_request(server, client):
    url = server["url"]
    stream, chunks = long_stream(client, 3)
    during = scrape(url)
    stream.close()  # the client leaves: the server aborts the request on its stages
    assert value(during, "omni_engine_stage_requests_running", stage="0") == 1
    assert value(during, "omni_engine_stage_requests_waiting", stage="0") == 0
    deadline = time.monotonic() + 15
    while True:
        after = scrape(url)
        if value(after, "omni_engine_stage_requests_aborted_total", stage="0") >= 1:
            break
        assert time.monotonic() < deadline, after.get("omni_engine_stage_requests_aborted_total")
        time.sleep(0.2)
    assert value(after, REQUESTS, outcome="aborted") >= 1
    assert value(after, "omni_engine_stage_requests_running", stage="0") == 0


def test_a_spoken_answer_moves_the_speech_stage_and_edge_metrics(server, client):
    """Chat with ``modalities: ["text", "audio"]`` runs stage 1 over the 0 -> 1 edge (skipped where the
    server has no audio chat)."""
    try:
        response = client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
            extra_body={"modalities": ["text", "audio"], "audio": {"voice": "en", "format": "wav"}})
    except openai.APIStatusError as exc:
        pytest.skip(f"no audio chat over HTTP: {exc.status_code} {exc.message}")
    audio = getattr(response.choices[0].message, "audio", None)
    if not audio:
        pytest.skip("no audio chat over HTTP: the answer has no audio")
    m = scrape(server["url"])
    for name in ("requests", "requests_finished", "outputs", "bytes_in", "bytes_out"):
        assert value(m, f"omni_engine_stage_{name}_total", stage="1") >= 1, name
    assert value(m, "omni_engine_stage_queue_time_seconds_count", stage="1") >= 1
    assert value(m, "omni_engine_stage_run_time_seconds_count", stage="1") >= 1
    assert value(m, f"{EDGE_HISTOGRAM}_count", src="0", dst="1") >= 1
    assert value(m, EDGE_BYTES, src="0", dst="1") > 0
    assert value(m, f"{TTFO}_count", stage="1") >= 1
    assert value(m, f"{E2E}_count", final_stages="0,1") >= 1


VLLM_SERIES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
               "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"]


def test_the_llm_stages_vllm_metrics_are_on_metrics_and_move_with_load(server, client, after_chats):
    """vLLM's own engine series of the LLM stage, fetched from the stage process at scrape time,
    labelled with its stage (the speech stage has none) and the served model name."""
    url = server["url"]
    before = scrape(url, "vllm:")
    for name in VLLM_SERIES:
        assert before.get(name), f"{name} missing from /metrics"
    stages = {labels["stage"] for samples in before.values() for labels, _ in samples}
    assert stages == {"0"}
    assert {labels["model_name"] for labels, _ in before["vllm:generation_tokens_total"]} == {MODEL}
    assert value(before, "vllm:time_to_first_token_seconds_count", stage="0", replica="0") >= 2  # the two chats
    assert value(before, "vllm:num_requests_running", stage="0") == 0

    stream, chunks = long_stream(client, 5)
    during = scrape(url, "vllm:")
    stream.close()
    assert value(during, "vllm:num_requests_running", stage="0") == 1
    assert value(during, "vllm:generation_tokens_total", stage="0") >= (
        value(before, "vllm:generation_tokens_total", stage="0") + chunks)
    assert value(during, "vllm:prompt_tokens_total", stage="0") > value(before, "vllm:prompt_tokens_total", stage="0")
    deadline = time.monotonic() + 15
    while value(after := scrape(url, "vllm:"), "vllm:num_requests_running", stage="0") != 0:
        assert time.monotonic() < deadline, "the aborted request still runs in the stage's vLLM"
        time.sleep(0.2)
    assert value(after, "vllm:generation_tokens_total", stage="0") >= value(
        during, "vllm:generation_tokens_total", stage="0")
    # The pipeline's own series are unchanged beside them.
    assert value(scrape(url), "omni_engine_stage_up", stage="0") == 1


def _events(lines) -> list[dict]:
    """The JSON events of an SSE stream's remaining lines, up to ``[DONE]``."""
    events = []
    for line in lines:
        if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
            events.append(json.loads(data))
    return events


def test_a_stage_killed_mid_answer_ends_the_stream_with_its_error_and_health_is_503_soon(server):
    # Last in this module: it kills the speech stage. A streamed chat with audio is answering when it
    # dies: its status line (200) and first text are sent, so the stream must end with an error
    # event naming the stage, not a finish that looks like an answer without its audio.
    url, log = server["url"], server["log"]
    assert http_status(f"{url}/health") == 200
    pids = _stage_pids(log)
    assert set(pids) == {0, 1}, log_tail(log)
    speech = psutil.Process(pids[1])
    assert speech.ppid() == server["proc"].pid
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Paris."}], "stream": True,
            "temperature": 0, "max_tokens": 96, "ignore_eos": True, "modalities": ["text", "audio"],
            "audio": {"voice": "en", "format": "wav"}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:  # up to the first piece of text: the answer is under way
            if line.startswith("data:") and '"content": "' in line and '"content": ""' not in line:
                break
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        while (status := http_status(f"{url}/health")) != 503:
            assert status == 200, status
            assert time.monotonic() - killed < 2.0, "/health still 200 two seconds after the stage was killed"
            time.sleep(0.05)
        assert time.monotonic() - killed < 2.0
        events = _events(lines)
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["type"] == "StageDeadError", events[-3:]
    assert "stage 1" in errors[0]["message"] and errors[0]["code"] == 500, errors
    assert not any(c.get("finish_reason") for e in events for c in e.get("choices") or ()), events[-3:]
    assert http_status(f"{url}/v1/models") == 200
    m = scrape(url)
    assert value(m, "omni_engine_stage_up", stage="1") == 0
    assert value(m, "omni_engine_stage_up", stage="0") == 1
    assert value(m, ERRORS, stage="1", error="StageDeadError") == 1
    # vLLM's watchdog (every 5 s) would stop a server whose engine died; ours keeps answering.
    time.sleep(6)
    assert server["proc"].poll() is None, log_tail(log)
    assert http_status(f"{url}/v1/models") == 200
    assert http_status(f"{url}/health") == 503


def test_the_rl_routes_are_absent_without_dev_mode(server):
    """As in vLLM: without VLLM_SERVER_DEV_MODE=1 nothing can pause the server or change its weights."""
    import httpx

    for method, path in (("POST", "/pause"), ("POST", "/update_weights"), ("GET", "/weight_info"),
                         ("POST", "/init_weight_transfer_engine"), ("POST", "/collective_rpc")):
        assert httpx.request(method, server["url"] + path, json={}, timeout=30).status_code == 404, path
