"""Piper neural speech: the phonemizer and voice models against piper-tts's own, the `piper-joe`
recipe, and the three-stage pipeline (SmolLM2 -> phonemizer -> Piper voice) with tensors crossing
the stage boundaries."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import pytest_asyncio

from omni_engine.engines.generation_model import GenerationRequest
from omni_engine.engines.piper import make_piper_phonemizer, make_piper_voice
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.entrypoints.openai.served_pipeline import speak
from omni_engine.errors import StageRequestError
from omni_engine.models.prepare import MARKER_FILE, prepare_model
from omni_engine.outputs import SPOKEN_TEXT
from omni_engine.pipeline.input_processors import split_sentences
from tests.otlp_receiver import OtlpReceiver, otlp_over_http
from tests.stress.checks import after_shutdown, wait_clean
from tests.stress.pipeline import REPO, speech_config, text_params

on_session_loop = pytest.mark.asyncio(loop_scope="session")

RATE = 22050
SENTENCE = "The capital of France is Paris."


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio)))) if audio.size else 0.0


@pytest.fixture(scope="module")
def voice_dir():
    return prepare_model("piper-joe")


@pytest.fixture(scope="module")
def phonemizer(voice_dir):
    return make_piper_phonemizer(model=str(voice_dir))


@pytest_asyncio.fixture(loop_scope="session")
async def voice(voice_dir):
    model = make_piper_voice(model=str(voice_dir))
    yield model
    await model.shutdown()


def test_piper_joe_is_prepared_from_its_package_and_then_found_at_once(tmp_path, voice_dir):
    fresh = prepare_model("piper-joe", cache_dir=tmp_path)
    assert {p.name for p in fresh.iterdir()} == {"en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json",
                                                 "MODEL_CARD", MARKER_FILE}
    assert (fresh / "en_US-joe-medium.onnx").read_bytes() == (voice_dir / "en_US-joe-medium.onnx").read_bytes()
    lines: list[str] = []
    assert prepare_model("piper-joe", cache_dir=tmp_path, progress=lines.append) == fresh
    assert lines == [f"done: piper-joe already prepared at {fresh}"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_a_voice_on_cores_of_its_own_sizes_its_threads_by_them(voice_dir):
    """``threads`` unset: one onnxruntime thread on a shared machine; pinned (runtime.cpus), one per
    core the process has (run in a process of its own: pinning this one would pin the test session)."""
    import subprocess
    import sys

    script = ("import os, sys; cores = [int(c) for c in sys.argv[2].split(',') if c]; "
              "cores and os.sched_setaffinity(0, cores); "
              "from omni_engine.utils import pinned_cores; "
              "from omni_engine.engines.piper import make_piper_voice; "
              "voice = make_piper_voice(model=sys.argv[1]); "
              "print(pinned_cores(), voice._session.get_session_options().intra_op_num_threads)")

    def pinned_and_threads(cores: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, str(voice_dir), cores], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert pinned_and_threads("") == "None 1"  # the machine's cores, shared: one thread
    assert pinned_and_threads("1") == "1 1"  # one core of its own
    if (os.cpu_count() or 2) > 2:
        assert pinned_and_threads("0,1") == "2 2"


def test_the_phonemizer_gives_the_ids_piper_itself_gives(voice_dir, phonemizer):
    from piper import PiperVoice as Reference

    reference = Reference.load(next(voice_dir.glob("*.onnx")))
    expected = reference.phonemes_to_ids([p for s in reference.phonemize(SENTENCE) for p in s])
    ids = phonemizer.phoneme_ids(SENTENCE)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.tolist() == expected
    assert phonemizer.phoneme_ids("   ").size == 0


@on_session_loop
async def test_the_voice_speaks_ids_and_speed_shortens_the_speech(phonemizer, voice):
    ids = phonemizer.phoneme_ids(SENTENCE)
    normal, fast = await voice.generate([GenerationRequest("n", {"phoneme_ids": ids}),
                                         GenerationRequest("f", {"phoneme_ids": ids}, {"speed": 2.0})])
    assert normal["sample_rate"] == fast["sample_rate"] == RATE
    assert normal["audio"].dtype == np.float32 and 1.0 < normal["audio"].size / RATE < 5.0
    assert rms(normal["audio"]) > 0.01
    # Durations are sampled (noise_w), so not exactly half: well under the normal length.
    assert fast["audio"].size < 0.75 * normal["audio"].size
    # vLLM's server sends every stage a SamplingParams: it means the defaults.
    from vllm import SamplingParams

    [default] = await voice.generate([GenerationRequest("d", {"phoneme_ids": ids}, SamplingParams())])
    assert rms(default["audio"]) > 0.01


@on_session_loop
async def test_bad_prompts_and_voices_fail_their_request_alone_naming_what_was_wrong(phonemizer, voice):
    ids = phonemizer.phoneme_ids("Yes.")
    as_list, ok, who, too_fast = await voice.generate([
        GenerationRequest("list", {"phoneme_ids": ids.tolist()}),
        GenerationRequest("ok", {"phoneme_ids": ids}, {"voice": "alloy"}),
        GenerationRequest("who", {"phoneme_ids": ids}, {"voice": "nobody"}),
        GenerationRequest("fast", {"phoneme_ids": ids}, {"speed": 9.0}),
    ])
    assert isinstance(as_list, TypeError) and "phoneme_ids of type list" in str(as_list)
    assert rms(ok["audio"]) > 0.01
    assert isinstance(who, ValueError) and "'nobody'" in str(who) and "'joe'" in str(who)
    assert isinstance(too_fast, ValueError) and "speed" in str(too_fast)
    assert voice.info()["voices"] == ["joe"] and voice.info()["voice_map"]["en"] == "joe"


@on_session_loop
async def test_a_voice_without_noise_speaks_the_same_samples_every_time(phonemizer, voice, voice_dir):
    ids = phonemizer.phoneme_ids(SENTENCE)
    request = lambda rid: GenerationRequest(rid, {"phoneme_ids": ids})  # noqa: E731
    sampled = [out["audio"] for out in await voice.generate([request("a"), request("b")])]
    assert not np.array_equal(*sampled)  # VITS samples its noise at every synthesis
    still = make_piper_voice(model=str(voice_dir), noise_scale=0, noise_w=0.0)
    try:
        first, second = [out["audio"] for out in await still.generate([request("c"), request("d")])]
        [again] = [out["audio"] for out in await still.generate([request("e")])]
        assert rms(first) > 0.01 and np.array_equal(first, second) and np.array_equal(first, again)
    finally:
        await still.shutdown()


def test_factories_name_the_engine_arg_that_is_wrong(tmp_path, voice_dir):
    with pytest.raises(TypeError, match=r"unknown engine_args \['voices'\]"):
        make_piper_voice(model=str(voice_dir), voices=["a"])
    with pytest.raises(TypeError, match="needs engine_args.model"):
        make_piper_phonemizer()
    with pytest.raises(ValueError, match="engine_args.threads must be an integer >= 1, got 0"):
        make_piper_voice(model=str(voice_dir), threads=0)
    with pytest.raises(ValueError, match="exactly one Piper voice"):
        make_piper_voice(model=str(tmp_path))
    (tmp_path / "x.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match=r"x\.onnx\.json is not a Piper voice config"):
        make_piper_phonemizer(model=str(tmp_path))
    with pytest.raises(ValueError, match="unknown voice 'bob'"):
        make_piper_voice(model=str(voice_dir), default_voice="bob")
    with pytest.raises(ValueError, match=r"engine_args.noise_w must be a number >= 0, got -0\.1"):
        make_piper_voice(model=str(voice_dir), noise_w=-0.1)
    with pytest.raises(ValueError, match="engine_args.noise_scale must be a number >= 0, got 'low'"):
        make_piper_voice(model=str(voice_dir), noise_scale="low")
    with pytest.raises(ValueError, match="engine_args.length_scale must be > 0"):
        make_piper_voice(model=str(voice_dir), length_scale=0)


# ---------------------------------------------------------------- the pipeline
@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def piper_pipeline(smollm2_path, receiver):
    """stage_configs/smollm2_piper.yaml with a 256-byte shared-memory threshold: a sentence's
    phoneme ids (> 32 ids) and its audio cross the stage boundaries through shared memory.
    Traced to ``receiver`` (OTLP/HTTP)."""
    config = speech_config(REPO / "stage_configs" / "smollm2_piper.yaml", model=smollm2_path, shm_threshold=256)
    with otlp_over_http():
        client = await MultiStageEngineClient.from_config(config.with_traces_endpoint(receiver.url))
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


async def spoken_answer(client, prompt: str, request_id: str, said: list[str] | None = None) -> tuple[str, list[np.ndarray]]:
    """The answer's text and each utterance's audio (copied: no output, so no shared-memory
    view of a stage, is kept once this returns); ``said`` gets what each utterance says."""
    text, audio = "", []
    async for out in client.generate(prompt, text_params(96), request_id, modalities=["text", "audio"]):
        if out.outputs:
            text += out.outputs[0].text
        if out.multimodal_output and out.multimodal_output.get("audio") is not None:
            assert out.multimodal_output["sample_rate"] == RATE
            audio.append(np.asarray(out.multimodal_output["audio"], dtype=np.float32).copy())
            if said is not None:
                said.append(out.multimodal_output.get(SPOKEN_TEXT))
    return text, audio


@on_session_loop
async def test_an_answer_is_spoken_sentence_by_sentence_with_tensors_between_the_stages(piper_pipeline, chat_prompt):
    client = piper_pipeline
    said: list[str] = []
    text, audio = await spoken_answer(client, chat_prompt("Tell me a short story about a cat."), "cat", said)
    sentences = split_sentences(text)
    assert len(sentences) >= 2, text
    assert len(audio) == len(sentences), (len(audio), sentences)  # one utterance per sentence, in order
    assert said == sentences  # each utterance says which text it speaks (through both Piper stages)
    assert rms(np.concatenate(audio)) > 0.01
    # The phonemizer's ids went out through its shared-memory pool (its segments hold bytes).
    stats = await client.stage_contexts[1].client.call_each_replica_async("shm_stats", call_timeout=10)
    assert all(stat["bytes"] > 0 for stat in stats.values()), stats
    assert not await wait_clean(client)


async def counted_answer(client, prompt: str, request_id: str, headers: dict) -> tuple[str, list[int], int]:
    """The answer's text, each utterance's length in samples, and its tokens (no output is kept, so
    no shared-memory view of a stage outlives this)."""
    text, audio, tokens = "", [], 0
    async for out in client.generate(prompt, text_params(64), request_id, modalities=["text", "audio"],
                                     trace_headers=headers):
        if out.outputs:
            text += out.outputs[0].text
            tokens += len(out.outputs[0].token_ids)
        if out.multimodal_output and out.multimodal_output.get("audio") is not None:
            audio.append(len(out.multimodal_output["audio"]))
    return text, audio, tokens


@on_session_loop
async def test_a_traced_answer_shows_each_stage_its_sentences_tensors_and_audio(piper_pipeline, chat_prompt,
                                                                                 receiver):
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    text, audio, tokens = await counted_answer(piper_pipeline, chat_prompt("Tell me a short story about a dog."),
                                               "traced-dog", headers)
    spans = receiver.wait_for(trace_id, lambda s: len(s) >= 4)
    stages = {s.attributes["omni.stage.id"]: s.attributes for s in spans if s.name.startswith("omni_stage ")}
    sentences = len(split_sentences(text))
    assert stages[0]["gen_ai.usage.completion_tokens"] == tokens and stages[0]["omni.stage.sub_requests"] == 1
    # One phonemizer and one voice request per sentence; the ids and the audio left through shared memory.
    assert stages[1]["omni.stage.name"] == "piper_phonemizer" and stages[1]["omni.stage.sub_requests"] == sentences
    assert stages[2]["omni.stage.name"] == "piper_voice" and stages[2]["omni.stage.sub_requests"] == sentences
    assert stages[1]["omni.stage.shm_bytes"] > 0
    assert stages[2]["omni.stage.shm_bytes"] >= 4 * sum(audio) - 256 * sentences  # float32 samples
    assert stages[2]["omni.stage.audio_seconds"] == pytest.approx(sum(audio) / RATE, abs=1e-3)
    assert not await wait_clean(piper_pipeline)


@on_session_loop
async def test_speech_without_the_llm_enters_at_the_phonemizer(piper_pipeline):
    """What /v1/audio/speech runs: text in at the first stage before the voice that takes text."""
    client = piper_pipeline
    assert client.text_entry_stage(2) == 1
    audio, rate = await speak(client, 2, "Hello world. How are you today?", {"speed": 1.0}, "speech")
    assert rate == RATE and 1.0 < audio.size / RATE < 6.0 and rms(audio) > 0.01
    assert not await wait_clean(client)


@on_session_loop
async def test_a_list_of_ids_is_refused_by_the_voice_stage_and_the_pipeline_serves_on(piper_pipeline):
    client = piper_pipeline
    with pytest.raises(StageRequestError, match="phoneme_ids of type list"):
        async for _ in client.generate({"phoneme_ids": [1, 2, 3]}, None, "as-list", entry_stage_id=2):
            pass
    audio, _ = await speak(client, 2, "Still here.", {}, "after")
    assert rms(audio) > 0.01
    assert not await wait_clean(client)


@on_session_loop
async def test_an_abort_mid_speech_leaves_nothing_in_any_stage(piper_pipeline, chat_prompt):
    client = piper_pipeline
    stream = client.generate(chat_prompt("Tell me a short story about a cat."), text_params(256), "story",
                             modalities=["text", "audio"])
    async for out in stream:
        if out.multimodal_output and out.multimodal_output.get("audio") is not None:
            break  # the first sentence is spoken: the LLM still writes, later sentences are in flight
    del out  # (its audio is a view of the voice stage's shared memory)
    await stream.aclose()
    assert not await wait_clean(client)
    audio, _ = await speak(client, 2, "After the abort.", {}, "after-abort")
    assert rms(audio) > 0.01


def test_a_voice_recipe_is_no_llm_model(tmp_path):
    """`piper-joe` prepares a Piper voice: named as an llm stage's model it is refused before
    anything starts; as a generation stage's model it is fine."""
    from omni_engine.config import parse_pipeline_config
    from omni_engine.models.check import ModelError, check_models

    def config(stage_type: str):
        args = {"model": "piper-joe"} if stage_type == "llm" else {
            "model_factory": "omni_engine.engines.piper:make_piper_voice", "model": "piper-joe"}
        return parse_pipeline_config({"stage_args": [{"stage_id": 0, "stage_type": stage_type, "engine_args": args,
                                                      "final_output": True, "final_output_type": "audio"}]})

    with pytest.raises(ModelError, match=r"stage_args\[0\]\.engine_args\.model"):
        check_models(config("llm"))
    check_models(config("generation"))
