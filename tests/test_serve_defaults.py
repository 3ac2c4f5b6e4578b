"""Served requests as vLLM's server treats them: a text stage's ``default_sampling_params`` fill the
fields a request leaves unset (a request's own value wins), vLLM's engine flags on the command line
set the engine of the pipeline's one llm stage, and every route of vLLM's chat and completion
handlers says which weights answered.

Two servers: the shared text server (``smollm2_text.yaml``: ``temperature: 0.0, max_tokens: 128``)
and one of this module's, the same pipeline with a default ``stop`` and started with engine flags.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from tests.serve_helpers import auth_headers, running_server

pytestmark = pytest.mark.llm

REPO = Path(__file__).resolve().parents[1]
TEXT_MODEL, FLAGGED_MODEL = "smollm2-test", "smollm2-flagged"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to sing."}]


@pytest.fixture(scope="module")
def flagged_server(tmp_path_factory):
    """smollm2_text.yaml with ``stop: ["Paris"]`` among its defaults, served with vLLM engine flags."""
    folder = tmp_path_factory.mktemp("flagged")
    config = yaml.safe_load((REPO / "stage_configs" / "smollm2_text.yaml").read_text())
    config["stage_args"][0]["default_sampling_params"] = {"temperature": 0.0, "max_tokens": 64, "stop": ["Paris"]}
    path = folder / "flagged.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(str(path), FLAGGED_MODEL, folder,
                        extra_args=("--max-logprobs", "30", "--max-model-len", "1024")) as srv:
        yield {**srv, "model": FLAGGED_MODEL}


def chat(server: dict, messages: list, path: str = "/v1/chat/completions", **fields) -> dict:
    body = {"model": server.get("model", TEXT_MODEL), "messages": messages, **fields}
    response = httpx.post(f"{server['url']}{path}", json=body, headers=auth_headers(server), timeout=300)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def test_a_chat_without_max_tokens_ends_at_the_stages_and_its_own_wins(text_server):
    unset = chat(text_server, STORY)
    assert (unset["usage"]["completion_tokens"], unset["choices"][0]["finish_reason"]) == (128, "length"), (
        "smollm2_text.yaml's max_tokens: 128 did not reach a request without max_tokens")
    own = chat(text_server, STORY, max_tokens=136)
    assert own["usage"]["completion_tokens"] == 136 and own["choices"][0]["finish_reason"] == "length"


def test_a_chat_without_temperature_is_greedy_as_the_stage_says_and_its_own_wins(text_server):
    greedy = chat(text_server, STORY, max_tokens=24, temperature=0.0)["choices"][0]["message"]["content"]
    unset = [chat(text_server, STORY, max_tokens=24)["choices"][0]["message"]["content"] for _ in range(2)]
    assert unset == [greedy] * 2, "smollm2_text.yaml's temperature: 0.0 did not reach a request without temperature"
    hot = chat(text_server, STORY, max_tokens=24, temperature=1.5, seed=7)["choices"][0]["message"]["content"]
    assert hot != greedy, "the request's own temperature lost"


def test_a_chat_without_stop_stops_where_the_stage_says_and_its_own_wins(flagged_server):
    unset = chat(flagged_server, CAPITAL)["choices"][0]
    assert unset["finish_reason"] == "stop" and "Paris" not in unset["message"]["content"], unset
    assert "France" in unset["message"]["content"], unset  # it answered, up to the stop string
    own = chat(flagged_server, CAPITAL, stop=["France"])["choices"][0]
    assert own["finish_reason"] == "stop" and "France" not in own["message"]["content"], own
    story = chat(flagged_server, STORY)  # no stop string in sight: the stage's max_tokens
    assert story["usage"]["completion_tokens"] == 64


def test_vllm_engine_flags_on_the_command_line_reach_the_llm_stage(flagged_server):
    models = httpx.get(f"{flagged_server['url']}/v1/models", headers=auth_headers(flagged_server), timeout=30)
    assert models.json()["data"][0]["max_model_len"] == 1024
    # vLLM's default --max-logprobs is 20: 25 is served only if the flag reached the stage's engine.
    answer = chat(flagged_server, CAPITAL, max_tokens=4, logprobs=True, top_logprobs=25)
    assert len(answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25


def test_every_route_of_vllms_chat_and_completion_handlers_says_which_weights_answered(text_server):
    fields = {"max_tokens": 4, "temperature": 0.0}
    reference = chat(text_server, CAPITAL, **fields)
    assert reference.get("weight_version") and reference.get("weight_versions"), reference
    for path, messages in (("/invocations", CAPITAL), ("/v1/chat/completions/batch", [CAPITAL, STORY])):
        answer = chat(text_server, messages, path=path, **fields)
        assert (answer.get("weight_version"), answer.get("weight_versions")) == (
            reference["weight_version"], reference["weight_versions"]), (path, answer)
