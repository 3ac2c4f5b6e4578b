"""The diffusers image stage, on a tiny random Stable Diffusion pipeline built here (no weights can be
downloaded): sizes and counts, seeds, batch independence, refusals, and a real stage process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

pytest.importorskip("diffusers")

from omni_engine.config import parse_pipeline_config, read_pipeline_yaml  # noqa: E402
from omni_engine.engines.diffusers_image import make_diffusers_image  # noqa: E402
from omni_engine.engines.generation_model import GenerationRequest  # noqa: E402
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient  # noqa: E402
from omni_engine.inputs import OmniDiffusionSamplingParams  # noqa: E402
from tests.stress.checks import after_shutdown, wait_clean  # noqa: E402
from tests.stress.pipeline import REPO  # noqa: E402

on_session_loop = pytest.mark.asyncio(loop_scope="session")
CONFIG = REPO / "stage_configs" / "diffusers_image.yaml"


def _byte_chars() -> list[str]:
    """CLIP's (GPT-2's) byte-level alphabet: one printable character per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(rest))]


def build_tiny_pipeline(path: Path) -> Path:
    """A random Stable Diffusion pipeline of ~1 MB: 32x32 images (VAE scale factor 8, like the real one)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tok_dir = path.parent / "tokenizer-src"
    tok_dir.mkdir()
    chars = _byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_dir), model_max_length=16)

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=4, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=(2, 4), norm_num_groups=32)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 32, 32), norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=32)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
        max_position_embeddings=16, projection_dim=32, bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"]))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny-sd") / "pipeline")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def model(pipeline_dir):
    model = make_diffusers_image(model=str(pipeline_dir), default_steps=2, max_images=4)
    yield model
    await model.shutdown()


def request(request_id: str, params: object, prompt: object = "a red cube") -> GenerationRequest:
    return GenerationRequest(request_id, prompt, params)


def differ(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


class CountingPipe:
    """The pipeline, counting its calls: batching is seen, not assumed."""

    def __init__(self, pipe) -> None:
        self.pipe, self.calls = pipe, 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.pipe(**kwargs)

    def __getattr__(self, name):
        return getattr(self.pipe, name)


# ---------------------------------------------------------------- the model
@on_session_loop
async def test_images_are_uint8_of_the_size_and_count_asked_for(model):
    square, wide = await model.generate([request("a", {"n": 2, "seed": 1}),
                                         request("b", {"n": 3, "seed": 1, "height": 16, "width": 40})])
    assert square["images"].shape == (2, 32, 32, 3) and square["images"].dtype == np.uint8
    assert square["size"] == "32x32" and square["seed"] == 1 and square["num_inference_steps"] == 2
    assert wide["images"].shape == (3, 16, 40, 3) and wide["size"] == "40x16"
    assert differ(square["images"][0], square["images"][1]) > 1  # n images, not one repeated
    assert model.info()["sizes"] == ["32x32"] and model.info()["max_images"] == 4


@on_session_loop
async def test_a_seed_gives_the_same_images_and_another_seed_others(model):
    first, other = await model.generate([request("a", {"n": 2, "seed": 7}), request("b", {"n": 2, "seed": 8})])
    # The same batch again: bit-identical. (Alone, it may differ by a level here and there: a batch's
    # size changes float summation order on some CPUs, as on the H200 machine's; see the next test.)
    again, _ = await model.generate([request("c", {"n": 2, "seed": 7}), request("d", {"n": 2, "seed": 8})])
    np.testing.assert_array_equal(first["images"], again["images"])
    assert differ(first["images"], other["images"]) > 1
    # Image i depends on (seed, i) alone: seed 8's first image is not seed 7's second.
    assert differ(first["images"][1], other["images"][0]) > 1
    unseeded, = await model.generate([request("d", {"n": 1})])
    repeat, = await model.generate([request("e", {"seed": unseeded["seed"]})])
    np.testing.assert_array_equal(unseeded["images"], repeat["images"])


@on_session_loop
async def test_a_request_s_images_do_not_depend_on_its_batch_mates(model, monkeypatch):
    alone, = await model.generate([request("alone", {"n": 1, "seed": 3})])
    counting = CountingPipe(model.pipe)
    monkeypatch.setattr(model, "pipe", counting)
    mate, me, other_steps, first_of_three = await model.generate([
        request("mate", {"n": 3, "seed": 11}, "a blue sphere"), request("me", {"n": 1, "seed": 3}),
        request("steps", {"n": 1, "seed": 3, "num_inference_steps": 3}), request("three", {"n": 3, "seed": 3})])
    assert counting.calls == 2  # mate, me and three share one call; steps=3 runs alone
    # Same seed, same latents; the batch only changes float summation order.
    assert np.abs(alone["images"].astype(int) - me["images"].astype(int)).max() <= 2
    assert np.abs(alone["images"][0].astype(int) - first_of_three["images"][0].astype(int)).max() <= 2
    assert differ(alone["images"], other_steps["images"]) > 1 and mate["images"].shape == (3, 32, 32, 3)


@on_session_loop
async def test_the_prompt_and_negative_prompt_change_the_images(model):
    base, prompt, negative = await model.generate([
        request("base", {"seed": 5}), request("prompt", {"seed": 5}, "a green tree"),
        request("neg", {"seed": 5, "negative_prompt": "blurry"})])
    assert differ(base["images"], prompt["images"]) > 0.5
    assert differ(base["images"], negative["images"]) > 0.5


@on_session_loop
async def test_omni_diffusion_sampling_params_are_read_like_the_dict(model):
    from_struct, from_dict = await model.generate([
        request("s", OmniDiffusionSamplingParams(num_inference_steps=2, guidance_scale=3.0, height=16, width=24,
                                                 seed=9, num_outputs_per_prompt=2)),
        request("d", {"num_inference_steps": 2, "guidance_scale": 3.0, "height": 16, "width": 24, "seed": 9,
                      "n": 2})])
    assert from_struct["images"].shape == (2, 16, 24, 3)
    assert np.abs(from_struct["images"].astype(int) - from_dict["images"].astype(int)).max() <= 2


@on_session_loop
async def test_bad_params_fail_their_request_alone_naming_the_field_and_the_request(model):
    results = await model.generate([
        request("r-n", {"n": 5}), request("r-ok", {"seed": 1}), request("r-h", {"height": 20}),
        request("r-x", {"size": "32x32"}), request("r-steps", {"num_inference_steps": 0}),
        request("r-seed", {"seed": -1}), request("r-w", {"width": 4096}), request("r-g", {"guidance_scale": "high"}),
        request("r-neg", {"negative_prompt": 3}), request("r-p", {"seed": 1}, prompt=42)])
    expected = {
        "r-n": "request r-n: params.n must be an integer in 1..4, got 5",
        "r-h": "request r-h: params.height must be a multiple of 8 in 8..2048, got 20",
        "r-x": "request r-x: unknown image params ['size']",
        "r-steps": "request r-steps: params.num_inference_steps must be an integer in 1..1000, got 0",
        "r-seed": "request r-seed: params.seed must be an integer in 0..2**63-1, got -1",
        "r-w": "request r-w: params.width must be a multiple of 8 in 8..2048, got 4096",
        "r-g": "request r-g: params.guidance_scale must be a number",
        "r-neg": "request r-neg: params.negative_prompt must be a string, got 3",
    }
    by_id = dict(zip(["r-n", "r-ok", "r-h", "r-x", "r-steps", "r-seed", "r-w", "r-g", "r-neg", "r-p"], results))
    assert by_id["r-ok"]["images"].shape == (1, 32, 32, 3)
    for rid, message in expected.items():
        assert isinstance(by_id[rid], ValueError) and message in str(by_id[rid]), (rid, by_id[rid])
    assert isinstance(by_id["r-p"], TypeError) and "prompt must be a str" in str(by_id["r-p"])


def test_the_factory_names_the_engine_arg_that_is_wrong(tmp_path, pipeline_dir):
    missing = tmp_path / "no-such-pipeline"
    with pytest.raises(ValueError, match=rf"engine_args.model: no directory '{missing}'"):
        make_diffusers_image(model=str(missing))
    with pytest.raises(ValueError, match=r"engine_args.model: .* is not a diffusers pipeline directory "
                                         r"\(no model_index.json there\)"):
        make_diffusers_image(model=str(tmp_path))
    with pytest.raises(TypeError, match=r"make_diffusers_image got unknown engine_args \['steps'\]"):
        make_diffusers_image(model=str(pipeline_dir), steps=2)
    with pytest.raises(TypeError, match="make_diffusers_image needs engine_args.model"):
        make_diffusers_image()
    with pytest.raises(ValueError, match="engine_args.dtype must be one of"):
        make_diffusers_image(model=str(pipeline_dir), dtype="float8")
    with pytest.raises(ValueError, match="engine_args.max_images must be an integer >= 1, got 0"):
        make_diffusers_image(model=str(pipeline_dir), max_images=0)
    with pytest.raises(ValueError, match="engine_args.size: the width, 30, must be a multiple of 8"):
        make_diffusers_image(model=str(pipeline_dir), size="30x32")


def test_the_shipped_config_names_the_factory_and_its_placeholder_is_refused_before_start():
    from omni_engine.models.check import ModelError, check_models

    config = parse_pipeline_config(read_pipeline_yaml(CONFIG), str(CONFIG))
    stage = config.stage_args[0]
    assert stage.engine_args["model_factory"] == "omni_engine.engines.diffusers_image:make_diffusers_image"
    with pytest.raises(ModelError, match=r"stage_args\[0\]\.engine_args\.model.*no such file or directory"):
        check_models(config)


# ---------------------------------------------------------------- a real stage process
@on_session_loop
async def test_the_stage_process_makes_the_images_the_route_serves(pipeline_dir, model):
    """The shipped config, its model pointed at the tiny pipeline: the route's path gives the images the
    in-process model gives for the same seed; a bad n fails naming the field and the request; nothing is left."""
    from omni_engine.entrypoints.openai.images import generate_images, image_stage_id, png_bytes
    from omni_engine.errors import StageRequestError

    data = read_pipeline_yaml(CONFIG)
    data.setdefault("runtime", {}).setdefault("connectors", {})["shm_threshold"] = 256  # images go through shm
    data["stage_args"][0]["engine_args"].update(model=str(pipeline_dir), default_steps=2)
    client = await MultiStageEngineClient.from_config(parse_pipeline_config(data, str(CONFIG)))
    try:
        assert image_stage_id(client) == 0 and client.text_entry_stage(0) == 0
        info = client.stage_info(0)
        assert info["sizes"] == ["32x32"] and info["max_images"] == 4 and info["pipeline"] == "StableDiffusionPipeline"
        images = await generate_images(client, 0, "a red cube", {"n": 2, "seed": 4}, "sd-1")
        local, = await model.generate([request("local", {"n": 2, "seed": 4})])
        assert [img.shape for img in images] == [(32, 32, 3)] * 2
        assert np.abs(np.stack(images).astype(int) - local["images"].astype(int)).max() <= 2
        assert png_bytes(images[0]).startswith(b"\x89PNG")
        with pytest.raises(StageRequestError, match=r"request sd-bad.*params\.n must be an integer in 1\.\.4"):
            await generate_images(client, 0, "a red cube", {"n": 9}, "sd-bad")
        assert not await wait_clean(client)
    finally:
        await client.shutdown_async()
    assert not await after_shutdown(client)
