"""``omni-engine serve``: the text pipeline behind vLLM's OpenAI server, used with the official client."""

from __future__ import annotations

import openai
import pytest

from tests.serve_helpers import openai_client

pytestmark = pytest.mark.llm

MODEL = "smollm2-test"  # the session's text_server serves this name
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(text_server):
    return text_server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


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


def test_abort_requests_without_ids_aborts_everything_and_streams_end_with_partial_output(server, client):
    """vLLM's RL route: no ids means every request in flight (vLLM's own handler asserts an
    AsyncLLM there); each aborted stream ends with its partial answer, finish_reason "abort"."""
    import httpx

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        temperature=0, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = ""
    while len(text) < 20:
        chunk = next(chunks)
        text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    response = httpx.post(f"{server['url']}/abort_requests", json={}, timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "aborted", "aborted": 1}, response.text
    rest = list(chunks)
    reasons = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert reasons == ["abort"], rest[-3:]
    for body, wrong in (([1, 2], "JSON object"), ({"request_ids": "x"}, "list of strings")):
        bad = httpx.post(f"{server['url']}/abort_requests", json=body, timeout=30)
        assert bad.status_code == 400 and wrong in bad.json()["error"], bad.text
    unknown = httpx.post(f"{server['url']}/abort_requests", json={"request_ids": ["no-such"]}, timeout=30)
    assert unknown.status_code == 200  # unknown ids are a no-op, as in vLLM
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in response.choices[0].message.content


def test_the_stages_start_before_the_server_imports_vllm(server):
    """``serve`` starts its stage processes first, so their imports overlap its own vLLM import, and
    their clients adopt them (checked by the server itself: vLLM was not in its modules then)."""
    log = server["log"].read_text(errors="replace")
    assert "1 stage(s) started; this process imports vLLM meanwhile" in log, log[-3000:]
    assert "stage 0: connecting to its process" in log
