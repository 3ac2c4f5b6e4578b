"""Stages import only what they run: a generation stage (eSpeak, Piper, the GANs) never imports
vLLM, and those whose model needs no torch do without torch too.

Each kind starts as a real stage process and is asked, after READY and again after serving real
requests (one with a vLLM ``SamplingParams``, as vLLM-Omni callers send to every stage), which
top-level packages it has loaded (the stage's ``loaded_packages`` utility reads its own
``sys.modules``). The llm stage is the negative control: the same question finds vLLM there.
Each request's output crosses the wire from the vLLM-free stage and arrives at the client as an
``OmniRequestOutput`` (audio, an integer tensor, images, a dict of scalars).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.outputs import CompletionOutput

from omni_engine.models.prepare import prepare_model
from omni_engine.outputs import OmniRequestOutput
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_process import StageProcessSpec
from tests.helpers import collect

pytestmark = pytest.mark.asyncio(loop_scope="session")

# kind -> (factory, the model's recipe or None, packages it must not load)
STAGE_KINDS = {
    "espeak": ("omni_engine.engines.tts:make_espeak_tts", None, {"vllm", "torch", "transformers", "PIL"}),
    "piper-phonemizer": ("omni_engine.engines.piper:make_piper_phonemizer", "piper-joe", {"vllm", "torch"}),
    "piper-voice": ("omni_engine.engines.piper:make_piper_voice", "piper-joe", {"vllm", "torch"}),
    "colour-picker": ("omni_engine.engines.gan_image:make_colour_picker", None, {"vllm", "torch"}),
    "eye-gan": ("omni_engine.engines.gan_image:make_eye_gan", "gan-eyes", {"vllm", "transformers"}),
}


def stage_spec(factory: str, recipe: str | None) -> StageProcessSpec:
    args = {"model_factory": factory}
    if recipe is not None:
        args["model"] = str(prepare_model(recipe))
    return StageProcessSpec("generation", args, max_batch_size=4)


@pytest.fixture(scope="module")
async def stages():
    """Every generation stage kind, started side by side (each in seconds, without vLLM)."""
    clients = {kind: StageEngineCoreClient(i, process=stage_spec(factory, recipe))
               for i, (kind, (factory, recipe, _)) in enumerate(STAGE_KINDS.items())}
    try:
        await asyncio.gather(*(client.start() for client in clients.values()))
        yield clients
    finally:
        await asyncio.gather(*(client.shutdown() for client in clients.values()), return_exceptions=True)


async def ask(client: StageEngineCoreClient, request_id: str, prompt, params) -> OmniRequestOutput:
    await client.submit_request(request_id, prompt, params)
    (output,) = await collect(client, request_id)
    assert isinstance(output, OmniRequestOutput) and output.finished
    return output


@pytest.mark.parametrize("kind", list(STAGE_KINDS))
async def test_a_generation_stage_loads_no_vllm_and_only_what_its_model_needs(stages, kind):
    forbidden = STAGE_KINDS[kind][2]
    loaded = set(await stages[kind].call_utility_async("loaded_packages"))
    assert "omni_engine" in loaded and "zmq" in loaded  # the list is the stage's own
    assert not loaded & forbidden, f"{kind} stage loaded {sorted(loaded & forbidden)} at start"


async def test_vllm_free_stages_serve_every_output_kind_and_take_vllm_params(stages):
    params = SamplingParams(max_tokens=7, temperature=0.5)  # what vLLM-Omni callers give every stage
    speech = await ask(stages["espeak"], "imp-espeak", "Hello from a stage without vLLM.", params)
    audio = speech.multimodal_output["audio"]
    assert speech.final_output_type == "audio" and audio.dtype == np.float32 and audio.size > 10000
    assert speech.outputs == [] and speech.stage_id == 0

    ids = await ask(stages["piper-phonemizer"], "imp-ids", "Hello there.", params)
    phonemes = ids.multimodal_output["phoneme_ids"]
    assert phonemes.dtype == np.int64 and phonemes.ndim == 1 and phonemes.size > 5
    voiced = await ask(stages["piper-voice"], "imp-voice", {"phoneme_ids": phonemes}, params)
    assert voiced.multimodal_output["sample_rate"] == 22050 and voiced.multimodal_output["audio"].size > 5000

    picked = await ask(stages["colour-picker"], "imp-colour", "I would say green.", params)
    assert picked.multimodal_output["colour"] == "green"
    label = picked.multimodal_output["label"]
    eyes = await ask(stages["eye-gan"], "imp-eyes", {"colour": "green", "label": label}, {"n": 2, "seed": 1})
    images = eyes.multimodal_output["images"]
    assert images.dtype == np.uint8 and images.shape == (2, 128, 128, 3)

    for kind, (_, _, forbidden) in STAGE_KINDS.items():  # decoding vLLM's params imported nothing either
        loaded = set(await stages[kind].call_utility_async("loaded_packages"))
        assert not loaded & forbidden, f"{kind} stage loaded {sorted(loaded & forbidden)} serving requests"


async def test_an_aborted_request_of_a_vllm_free_stage_ends_as_vllm_s_abort_output(stages):
    client = stages["espeak"]
    # Long enough that the abort lands while eSpeak still speaks (a batch is cancelled as a whole).
    await client.submit_request("imp-abort", "A sentence to speak at length. " * 60, None)
    await client.abort_request("imp-abort", keep_final=True)
    (output,) = await collect(client, "imp-abort")
    (completion,) = output.outputs
    assert type(completion) is CompletionOutput and completion.finish_reason == "abort"
    assert output.final_output_type == "audio" and output.multimodal_output == {}


async def test_the_llm_stage_is_the_negative_control_it_loads_vllm(llm_stage):
    loaded = set(await llm_stage.call_utility_async("loaded_packages"))
    assert {"vllm", "torch"} <= loaded


async def test_a_stage_process_is_named_for_top_and_keeps_its_environment_readable(stages):
    import psutil

    for i, client in enumerate(stages.values()):
        proc = psutil.Process(client.process.pid)
        assert proc.name() == f"omni-stage{i}"
        # Named through Linux's comm, not the command line: /proc/<pid>/environ is intact.
        assert "PATH" in proc.environ()
