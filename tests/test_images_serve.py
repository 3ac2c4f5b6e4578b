"""``omni-engine serve`` of stage_configs/smollm2_eyes.yaml: OpenAI's ``/v1/images/generations``
through the official ``openai`` client, and its 400s/404.

Not faces.yaml: ``omni-engine serve`` refuses a pipeline without an llm stage (vLLM's server
needs a text stage). The route enters at the colour picker (the first non-LLM stage before the
image stage, as /v1/audio/speech enters at the speech stage), so the prompt's colour word picks
the label; faces.yaml is tested in-process in test_images.py."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from tests.serve_helpers import openai_client, running_server

pytestmark = pytest.mark.llm

MODEL = "smollm2-eyes"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    with running_server("stage_configs/smollm2_eyes.yaml", MODEL, tmp_path_factory.mktemp("serve-eyes")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def decode(b64: str) -> np.ndarray:
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(data)) as img:
        assert (img.format, img.mode, img.size) == ("PNG", "RGB", (128, 128))
        return np.asarray(img)


def test_two_green_eyes_come_back_as_128x128_pngs(client):
    # Seeded: the bounds below hold for every seed measured (pixel std >= 15.7 and a mean difference
    # between the two >= 46 over seeds 0..39), but a test must not draw its own luck (seed 3:
    # std 50 and 56, difference 46).
    result = client.images.generate(model=MODEL, prompt="a green eye", n=2, size="128x128",
                                    response_format="b64_json", extra_body={"seed": 3})
    images = [decode(item.b64_json) for item in result.data]
    assert len(images) == 2
    assert all(img.std() > 10 for img in images)  # pictures, not a constant
    assert np.abs(images[0].astype(int) - images[1].astype(int)).mean() > 10  # two different eyes


def test_a_seed_gives_the_same_png(client):
    def once() -> str:
        return client.images.generate(model=MODEL, prompt="a green eye", response_format="b64_json",
                                      extra_body={"seed": 5}).data[0].b64_json

    assert once() == once()


@pytest.mark.parametrize("kwargs, param, message", [
    ({"n": 9}, "n", "n must be between 1 and 8"),
    ({"size": "256x256"}, "size", "this model makes ['128x128']"),
    ({"response_format": "url"}, "response_format", "response_format 'url' is not supported"),
    ({"prompt": "  "}, "prompt", "prompt must not be empty"),
])
def test_bad_input_is_a_400_naming_the_field(client, kwargs, param, message):
    args = {"model": MODEL, "prompt": "a green eye", "response_format": "b64_json", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(**args)
    error = info.value.body if isinstance(info.value.body, dict) else {}
    error = error.get("error", error)
    assert error.get("param") == param and message in error.get("message", ""), info.value.body


def test_a_prompt_naming_no_colour_is_a_400_listing_the_accepted_words(client):
    with pytest.raises(openai.BadRequestError, match="names no eye colour; accepted words"):
        client.images.generate(model=MODEL, prompt="an eye", response_format="b64_json")


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.images.generate(model="dall-e-3", prompt="a green eye", response_format="b64_json")


def test_bench_images_times_each_generation(server, tmp_path):
    """``omni-engine bench serve --backend openai-images``: one image per request, each timed; a
    prompt the server refuses is counted failed with its error."""
    import argparse
    import asyncio
    import json

    from omni_engine.bench.serve_bench import add_arguments, run_benchmark

    dataset = tmp_path / "eyes.jsonl"
    dataset.write_text(json.dumps({"prompt": "a green eye"}) + "\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "openai-images", "--base-url", server["url"], "--dataset-name", "custom",
                              "--dataset-path", str(dataset), "--num-prompts", "3", "--max-concurrency", "2",
                              "--disable-tqdm"])
    result = asyncio.run(run_benchmark(args))
    assert (result["completed"], result["failed"], result["model_id"]) == (3, 0, MODEL)
    assert result["mean_e2el_ms"] > 0 and result["request_throughput"] > 0
    args.model = "no-such-model"
    refused = asyncio.run(run_benchmark(args))
    assert refused["completed"] == 0 and refused["failed"] == 3
    assert refused["errors"][0].startswith("HTTP 404") and "no-such-model" in refused["errors"][0]
