"""Overload at the server: past ``runtime.max_inflight_requests`` a request is
answered with HTTP 503 (OpenAI clients and load balancers retry it) and the
server serves on."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import yaml

from tests.serve_helpers import openai_client, running_server

pytestmark = pytest.mark.llm

MODEL = "smollm2-overload-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("serve_overload")
    config = yaml.safe_load(open("stage_configs/smollm2_text.yaml"))
    config["runtime"]["max_inflight_requests"] = 1
    path = tmp / "one_at_a_time.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(str(path), MODEL, tmp) as srv:
        yield srv


def ask(client, max_tokens: int):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True})


def test_requests_past_the_limit_get_503_and_the_server_serves_on(server):
    client = openai_client(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, client, 120) for _ in range(4)]
        results = []
        for f in futures:
            try:
                results.append(f.result(timeout=120))
            except openai.APIStatusError as exc:
                results.append(exc)
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert served and refused, results
    for exc in refused:
        assert exc.status_code == 503, exc
        assert "max_inflight_requests" in str(exc)
    assert all(r.choices[0].message.content for r in served)
    # Once the load is gone, requests are served again.
    assert ask(client, 8).choices[0].message.content
