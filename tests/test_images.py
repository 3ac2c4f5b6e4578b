"""Image generation stages: the two DCGANs from PyPI (faces 64x64, eyes 128x128 in 8 colours),
their recipes, and the eyes pipeline (SmolLM2 picks the colour -> colour picker -> eye GAN)."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from omni_engine.engines.gan_image import (
    ColourPicker,
    colour_question,
    make_colour_picker,
    make_eye_gan,
    make_face_gan,
)
from omni_engine.engines.generation_model import GenerationRequest
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.models.dcgan import EYE_COLOURS
from omni_engine.models.prepare import MARKER_FILE, prepare_model
from tests.stress.checks import after_shutdown, wait_clean
from tests.stress.pipeline import REPO, speech_config

on_session_loop = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def faces_dir():
    return prepare_model("gan-faces")


@pytest.fixture(scope="module")
def eyes_dir():
    return prepare_model("gan-eyes")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def faces(faces_dir):
    model = make_face_gan(model=str(faces_dir))
    yield model
    await model.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def eyes(eyes_dir):
    model = make_eye_gan(model=str(eyes_dir), max_images=16)
    yield model
    await model.shutdown()


def request(request_id: str, params: dict | None, prompt: object = "") -> GenerationRequest:
    return GenerationRequest(request_id, prompt, params)


def green_share(images: np.ndarray) -> float:
    """The share of pixels whose green clearly exceeds red and blue (by 8 levels, past JPEG-like noise)."""
    px = images.astype(np.int16)
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    return float(((g > r + 8) & (g > b + 8)).mean())


# ---------------------------------------------------------------- recipes
@pytest.mark.parametrize("name, files", [
    ("gan-faces", {"weights.tar", "LICENSE"}),
    ("gan-eyes", {"generator_model_state.pth"}),
])
def test_the_gan_recipes_prepare_into_the_cache_and_then_find_it_at_once(tmp_path, name, files):
    fresh = prepare_model(name, cache_dir=tmp_path)
    assert fresh.parent == tmp_path / "models"
    assert {p.name for p in fresh.iterdir()} == files | {MARKER_FILE}
    before = {p.name: p.stat().st_mtime_ns for p in fresh.iterdir()}
    lines: list[str] = []
    assert prepare_model(name, cache_dir=tmp_path, progress=lines.append) == fresh
    assert lines == [f"done: {name} already prepared at {fresh}"]
    assert {p.name: p.stat().st_mtime_ns for p in fresh.iterdir()} == before  # nothing rewritten


# ---------------------------------------------------------------- the models
@on_session_loop
async def test_faces_are_uint8_64x64_and_a_seed_gives_the_same_images(faces):
    first, again, other = await faces.generate([request("a", {"n": 2, "seed": 7}), request("b", {"n": 2, "seed": 7}),
                                                request("c", {"n": 2, "seed": 8})])
    assert first["images"].shape == (2, 64, 64, 3) and first["images"].dtype == np.uint8
    assert first["seed"] == 7 and first["size"] == "64x64"
    np.testing.assert_array_equal(first["images"], again["images"])
    assert np.abs(first["images"].astype(int) - other["images"].astype(int)).mean() > 10
    assert np.abs(first["images"][0].astype(int) - first["images"][1].astype(int)).mean() > 10  # n images differ
    # A real face, not a constant or noise: the pixels spread over the range, neighbours correlate.
    img = first["images"][0].astype(float)
    assert img.std() > 20
    assert np.corrcoef(img[:, :-1].ravel(), img[:, 1:].ravel())[0, 1] > 0.8


@on_session_loop
async def test_a_request_s_images_do_not_depend_on_its_batch_mates(faces):
    alone, = await faces.generate([request("alone", {"n": 1, "seed": 3})])
    _, batched = await faces.generate([request("mate", {"n": 5, "seed": 11}), request("me", {"n": 1, "seed": 3})])
    # Same seed, same latents; the batch only changes float summation order.
    assert np.abs(alone["images"].astype(int) - batched["images"].astype(int)).max() <= 2


@on_session_loop
async def test_without_a_seed_each_request_gets_its_own_and_says_which(faces):
    a, b = await faces.generate([request("a", None), request("b", {"n": 1})])
    assert a["seed"] != b["seed"]
    again, = await faces.generate([request("again", {"seed": a["seed"]})])
    np.testing.assert_array_equal(a["images"], again["images"])


@on_session_loop
async def test_bad_params_fail_their_request_alone_naming_the_field_and_the_request(faces):
    bad_n, good, bad_seed, unknown, colour = await faces.generate([
        request("r-n", {"n": 9}), request("r-ok", {"n": 1, "seed": 1}), request("r-seed", {"seed": -1}),
        request("r-x", {"size": "64x64"}), request("r-col", {"colour": "green"})])
    assert isinstance(bad_n, ValueError) and "request r-n: params.n must be an integer in 1..8, got 9" in str(bad_n)
    assert good["images"].shape == (1, 64, 64, 3)
    assert isinstance(bad_seed, ValueError) and "request r-seed: params.seed" in str(bad_seed)
    assert isinstance(unknown, ValueError) and "request r-x: unknown image params ['size']" in str(unknown)
    assert isinstance(colour, ValueError) and "request r-col: params.colour" in str(colour)


def test_factories_name_the_engine_arg_that_is_wrong(tmp_path, faces_dir):
    with pytest.raises(TypeError, match=r"make_face_gan got unknown engine_args \['size'\]"):
        make_face_gan(model=str(faces_dir), size=64)
    with pytest.raises(TypeError, match="make_eye_gan needs engine_args.model"):
        make_eye_gan()
    with pytest.raises(ValueError, match="engine_args.threads must be an integer >= 1, got 0"):
        make_face_gan(model=str(faces_dir), threads=0)
    with pytest.raises(ValueError, match="engine_args.max_images must be an integer >= 1, got 0"):
        make_face_gan(model=str(faces_dir), max_images=0)
    with pytest.raises(ValueError, match=r"engine_args.model: no generator_model_state.pth at .*prepare-model gan-eyes"):
        make_eye_gan(model=str(tmp_path))
    with pytest.raises(TypeError, match=r"make_colour_picker got unknown engine_args \['model'\]"):
        make_colour_picker(model="x")


@on_session_loop
async def test_eyes_are_128x128_of_the_colour_asked_for(eyes):
    """The green label's eyes have far more green-dominant pixels than any other label's.

    Measured (16 images each, seeds 0, 1, 2): most of an eye image is skin, red-dominant for every
    label, so "the image is green" is not true; what is true and robust is that green-dominant
    pixels (the iris) are 15-19% of a green eye's and under 5% of any other colour's (hazel, a
    greenish brown, comes nearest at 3-4%; blue, gray and brown stay under 1%).
    """
    shares = {}
    for colour in EYE_COLOURS:
        out, = await eyes.generate([request(colour, {"n": 16, "seed": 0, "colour": colour})])
        assert out["images"].shape == (16, 128, 128, 3) and out["images"].dtype == np.uint8
        assert (out["colour"], out["label"]) == (colour, EYE_COLOURS.index(colour))
        shares[colour] = green_share(out["images"])
    others = max(v for k, v in shares.items() if k != "green")
    assert shares["green"] > 3 * others and shares["green"] > 0.1, shares


@on_session_loop
async def test_the_prompt_s_colour_wins_over_the_params_and_a_bad_one_names_the_labels(eyes):
    from_prompt, bad, missing = await eyes.generate([
        request("p", {"seed": 1, "colour": "blue"}, {"colour": "green", "label": 5}),
        request("bad", {"colour": "purple"}), request("none", {"n": 1})])
    assert from_prompt["colour"] == "green"
    assert isinstance(bad, ValueError) and "request bad: colour 'purple'" in str(bad) and "'hazel'" in str(bad)
    assert isinstance(missing, ValueError) and "request none: colour None" in str(missing)


@pytest.mark.parametrize("answer, colour", [
    ("Green", "green"), ("green.", "green"), ("The colour is grey", "gray"), ("grayscale", "grayscale"),
    ("Hazel eyes", "hazel"), ("  BLUE  ", "blue"),
])
def test_the_colour_picker_reads_the_llm_s_word(answer, colour):
    assert ColourPicker().pick(answer) == colour


def test_the_colour_picker_names_the_words_it_accepts():
    with pytest.raises(ValueError, match=r"request r7: the answer 'purple' names no eye colour; accepted words: .*'amber'"):
        ColourPicker().pick("purple", "r7")


# ---------------------------------------------------------------- the eyes pipeline
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def eyes_pipeline(smollm2_path):
    config = speech_config(REPO / "stage_configs" / "smollm2_eyes.yaml", model=smollm2_path, shm_threshold=256)
    client = await MultiStageEngineClient.from_config(config)
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


@pytest.mark.llm
@on_session_loop
async def test_the_llm_picks_green_for_a_green_eye_and_the_gan_draws_it(eyes_pipeline, chat_prompt):
    client = eyes_pipeline
    assert client.stage_for_output("image") == 2
    answer, outputs = "", []
    async for out in client.generate(chat_prompt(colour_question("a green eye")), {2: {"n": 8, "seed": 0}},
                                     "green-eye", final_stage_id=[0, 2]):
        if out.outputs:
            answer = out.outputs[0].text  # cumulative: the answer so far
        if out.multimodal_output and out.multimodal_output.get("images") is not None:
            outputs.append({k: (np.array(v) if k == "images" else v) for k, v in out.multimodal_output.items()})
    assert "green" in answer.lower(), answer  # the LLM's answer, greedy
    assert len(outputs) == 1
    out = outputs[0]
    # The eye GAN stage's input was the picker's {"colour", "label"}: it echoes both.
    assert (out["colour"], out["label"]) == ("green", EYE_COLOURS.index("green"))
    assert out["images"].shape == (8, 128, 128, 3)
    assert green_share(out["images"]) > 0.1
    assert not await wait_clean(client)


# ---------------------------------------------------------------- faces.yaml, in-process
@on_session_loop
async def test_faces_yaml_makes_faces_through_what_the_images_route_runs(faces_dir):
    """faces.yaml prepares `gan-faces` at start; the route's path (entry and final: the GAN stage)
    gives n PNG-ready images, a seed repeats them, and a bad n fails naming the field and request."""
    from omni_engine.entrypoints.openai.images import generate_images, image_stage_id, png_bytes
    from omni_engine.errors import StageRequestError

    client = await MultiStageEngineClient.from_config(speech_config(REPO / "stage_configs" / "faces.yaml"))
    try:
        assert image_stage_id(client) == 0 and client.text_entry_stage(0) == 0
        assert client.stage_info(0)["sizes"] == ["64x64"]
        first = await generate_images(client, 0, "a face", {"n": 3, "seed": 4}, "faces-1")
        again = await generate_images(client, 0, "a face", {"n": 3, "seed": 4}, "faces-2")
        assert [img.shape for img in first] == [(64, 64, 3)] * 3
        np.testing.assert_array_equal(np.stack(first), np.stack(again))
        assert png_bytes(first[0]).startswith(b"\x89PNG")
        with pytest.raises(StageRequestError, match=r"request faces-bad.*params\.n must be an integer in 1\.\.8"):
            await generate_images(client, 0, "a face", {"n": 9}, "faces-bad")
        assert not await wait_clean(client)
    finally:
        await client.shutdown_async()
    assert not await after_shutdown(client)
