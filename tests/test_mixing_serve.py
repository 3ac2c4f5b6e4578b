"""``omni-engine serve`` of the example mixing pipeline (stage_configs/smollm2_mixing.yaml):
theta prompts arrive as ``vllm_xargs``, a request without one is a 400 naming the field,
and served requests get their α history lines."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import yaml

from tests.serve_helpers import running_server

pytestmark = pytest.mark.llm

MODEL = "smollm2-mixing"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("mixing_serve")
    config = yaml.safe_load(open("stage_configs/smollm2_mixing.yaml"))
    for stage in config["stage_args"]:
        stage["runtime"]["max_batch_size"] = 4
        stage["engine_args"]["max_model_len"] = 512
    config["stage_args"][0]["mixing"]["alpha_history"] = str(tmp / "alpha.jsonl")
    path = tmp / "mixing.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(str(path), MODEL, tmp) as srv:
        yield {**srv, "history": tmp / "alpha.jsonl"}


def history_lines(path, count: int, timeout: float = 20.0) -> dict[str, dict]:
    """The α history by request id, once it has ``count`` lines (a line is written when the
    teacher's batch next changes after a request's end) or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while True:
        lines = {line["request_id"]: line for line in map(json.loads, path.read_text().splitlines())} \
            if path.exists() else {}
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def test_a_request_without_a_theta_prompt_is_a_400_and_the_server_serves_on(server):
    r = httpx.post(f"{server['url']}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "theta_prompt" in r.json()["error"]["message"]
    r = httpx.post(f"{server['url']}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 4, "vllm_xargs": {"theta_prompt": "Hi", "mixing_alpha": "median"}})
    assert r.status_code == 400 and "mixing_alpha" in r.json()["error"]["message"], r.text


def test_chat_and_completions_mix_with_the_requests_own_theta_prompt(server):
    chat = httpx.post(f"{server['url']}/v1/chat/completions", timeout=120, headers={"X-Request-Id": "mix-chat"}, json={
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is 7 times 6? The reference answer is 42."}],
        "vllm_xargs": {"theta_prompt": "What is 7 times 6?"}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    done = httpx.post(f"{server['url']}/v1/completions", timeout=120, headers={"X-Request-Id": "mix-cmpl"}, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "vllm_xargs": {"theta_prompt": "Name a city.", "mixing_alpha": "fixed", "mixing_alpha_value": 0.25}})
    assert done.status_code == 200, done.text
    lines = history_lines(server["history"], 2)
    chat_line = next(line for rid, line in lines.items() if "mix-chat" in rid)
    cmpl_line = lines["cmpl-mix-cmpl-0"]
    assert chat_line["alpha_method"] == "kl_symmetry" and chat_line["steps"] >= 1
    assert cmpl_line["alpha"] == [0.25] * 6 and cmpl_line["alpha_method"] == "fixed"
