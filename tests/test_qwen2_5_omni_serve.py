"""``omni-engine serve`` of a Qwen2.5-Omni checkpoint directory, called as OpenAI clients call it.

The server finds the family's pipeline (thinker -> talker -> code2wav) by the checkpoint's
architecture. Chat with ``modalities: ["text", "audio"]`` must answer with transformers' text and
the waveform transformers' talker and token2wav make for it (a greedy talker, through the
``sampling_params_list`` request field), with the voice asked for; ``input_audio`` and ``image_url``
parts reach the thinker, which hears and sees them. Bad input is refused by field, and the server
serves on.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

from omni_engine.audio import decode_audio, encode_audio
from tests.qwen_omni_reference import (
    MAX_TOKENS,
    TALKER_TOKENS,
    chat,
    image,
    reference_codes,
    reference_run,
    reference_wav,
    tone,
)
from tests.serve_helpers import audio_chat, running_server

SERVED = "qwen-omni-tiny"
# A greedy talker with the config's other defaults (its stop codes, repetition penalty)
GREEDY_TALKER = [None, {"temperature": 0.0, "max_tokens": TALKER_TOKENS}]
PCM16_STEP = 1 / 32768
QUESTION = "What is the capital of France?"


# vLLM-Omni's deploy YAML, its fields: the talker greedy by default here (so a chat without
# sampling_params_list gets transformers' codes), vLLM knobs on code2wav (which runs no vLLM engine),
# a platform block for this machine and one for another; code2wav streams its pieces (async_chunk).
DEPLOY = f"""
async_chunk: true
stages:
  - stage_id: 1
    max_num_seqs: 4
    enforce_eager: true
    default_sampling_params: {{temperature: 0.0, max_tokens: {TALKER_TOKENS}, seed: 42}}
  - stage_id: 2
    max_num_seqs: 2
    enforce_eager: true
    gpu_memory_utilization: 0.15
    default_sampling_params: {{temperature: 0.0, top_p: 1.0, seed: 0}}
platforms:
  cpu:
    stages:
      - {{stage_id: 0, max_num_seqs: 4, mm_processor_cache_gb: 0}}
  npu:
    stages:
      - {{stage_id: 0, enforce_eager: false, devices: "7"}}
"""


@pytest.fixture(scope="module")
def server(omni_dir, tmp_path_factory):
    """``serve DIR --deploy-config`` (the family's pipeline, by the checkpoint's architecture)."""
    work = tmp_path_factory.mktemp("qwen_serve")
    deploy = work / "deploy.yaml"
    deploy.write_text(DEPLOY)
    with running_server(str(omni_dir), SERVED, work, extra_args=("--deploy-config", str(deploy))) as srv:
        yield srv


def _post(server, body, timeout=120):
    return httpx.post(f"{server['url']}/v1/chat/completions", json={"model": SERVED, **body}, timeout=timeout)


def _heard_tone():
    """The tone sent as 16-bit WAV, and the samples it decodes to (what the thinker hears)."""
    wav = encode_audio(tone(), 16000, "wav")
    return wav, decode_audio(wav, 16000)


def _png(picture):
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _messages(kind):
    """The chat for a prompt kind, and the prompt transformers is given for it (the same text the
    checkpoint's chat template renders)."""
    if kind == "text":
        return [{"role": "user", "content": QUESTION}], (chat(QUESTION), {})
    if kind == "audio":
        wav, heard = _heard_tone()
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode("ascii"), "format": "wav"}}
        return ([{"role": "user", "content": [part, {"type": "text", "text": "What did you hear?"}]}],
                (chat("<|audio_bos|><|AUDIO|><|audio_eos|>What did you hear?"), {"audio": (heard, 16000)}))
    picture = image()
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_png(picture)}"}}
    return ([{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}],
            (chat("<|vision_bos|><|IMAGE|><|vision_eos|>Describe it."), {"image": picture}))


def _audio_chat(server, messages, voice=None, stream=False, per_stage=GREEDY_TALKER):
    """The text and the waveform (float32, 24 kHz) of a chat with audio, streamed or whole."""
    audio = {"format": "pcm16", **({"voice": voice} if voice else {})}
    body = {"model": SERVED, "messages": messages, "modalities": ["text", "audio"], "audio": audio,
            "temperature": 0.0, "max_tokens": MAX_TOKENS, "stream": stream,
            **({"sampling_params_list": per_stage} if per_stage is not None else {})}
    text, samples, _ = audio_chat(server["url"], body)
    return text, samples


@pytest.mark.parametrize(("kind", "voice", "stream"), [("text", "Ethan", False), ("audio", None, True)])
def test_a_chat_with_audio_answers_transformers_text_and_speech(server, reference, kind, voice, stream):
    """Through the server: the thinker's greedy text, then the audio of the talker's greedy codes in
    the voice asked for (default Chelsie), as transformers makes both (pcm16: within a step of it)."""
    messages, prompt = _messages(kind)
    want_ids, _, _ = reference_run(reference, prompt)
    want_text = reference[1].tokenizer.decode(want_ids, skip_special_tokens=True)
    codes = reference_codes(reference, prompt, voice or "Chelsie")
    want = reference_wav(reference, codes, voice or "Chelsie")
    text, audio = _audio_chat(server, messages, voice=voice and voice.lower(), stream=stream)
    assert text == want_text
    assert audio.shape == want.shape == (len(codes) * 2 * 240,)
    np.testing.assert_allclose(audio, np.clip(want, -1, 1), atol=1e-4 + PCM16_STEP, rtol=0)


def test_the_deploy_config_is_honoured_and_what_it_cannot_act_on_is_said(server, reference):
    """Its greedy talker is the default: a chat without sampling_params_list gets transformers' codes
    (the family's own default samples at temperature 0.9); code2wav's vLLM knobs are named."""
    messages, prompt = _messages("text")
    codes = reference_codes(reference, prompt, "Chelsie")
    want = reference_wav(reference, codes, "Chelsie")
    _, audio = _audio_chat(server, messages, per_stage=None)
    np.testing.assert_allclose(audio, np.clip(want, -1, 1), atol=1e-4 + PCM16_STEP, rtol=0)
    notes = [line for line in server["log"].read_text().splitlines() if "deploy config: " in line]
    for field in ("stages[1].enforce_eager", "stages[1].gpu_memory_utilization", "temperature, top_p"):
        assert any(field in line and "stage 2" in line for line in notes), (field, notes)
    assert len(notes) == 3, notes  # the llm stages' fields were all taken


def test_an_image_reaches_the_thinker(server, reference):
    messages, prompt = _messages("image")
    want_ids, _, _ = reference_run(reference, prompt)
    response = _post(server, {"messages": messages, "temperature": 0.0, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reference[1].tokenizer.decode(
        want_ids, skip_special_tokens=True)


def test_the_voices_are_the_checkpoint_s_speakers(server):
    listing = httpx.get(f"{server['url']}/v1/audio/voices", timeout=30).json()
    assert [v["id"] for v in listing["data"]] == ["Chelsie", "Ethan"]
    assert listing["default"] == "Chelsie"


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio.voice", "this model's: Chelsie, Ethan"),
    ({"sampling_params_list": [None, {"temprature": 0}]}, "sampling_params_list[1]", "temprature"),
    ({"sampling_params_list": [None, None, None, {}]}, "sampling_params_list", "at most 3"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not audio at all").decode(),
                                                "format": "wav"}}]}]},
     "messages[0].content[0].input_audio", "messages[0].content[0].input_audio"),
])
def test_bad_input_is_refused_by_field_and_the_server_serves_on(server, body, param, says):
    request = {"messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
               "audio": {"format": "wav"}, "max_tokens": 2, **body}
    response = _post(server, request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    again = _post(server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert again.status_code == 200, again.text


def test_text_to_speech_is_refused_by_name_where_the_speech_stage_speaks_codes(server):
    """/v1/audio/speech reads text aloud with the speech stage alone; code2wav speaks talker codes."""
    response = httpx.post(f"{server['url']}/v1/audio/speech", json={"model": SERVED, "input": "Hello there."},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and "speaks its talker's codes" in error["message"], error


@pytest.mark.asyncio(loop_scope="module")
async def test_realtime_the_thinker_hears_the_turn_and_answers_in_transformers_speech(server, reference):
    """``/v1/realtime`` on the family: a committed turn of audio goes to the thinker itself (no
    speech-to-text stage: transcription is off, and asking for it is refused by name); the answer is
    transformers' text for that audio and the speech of transformers' greedy talker, in the
    checkpoint's default voice."""
    import base64 as b64

    from omni_engine.realtime.audio_io import StreamResampler
    from tests.realtime_helpers import aclient, answer_audio, events_until, of_type

    pcm = _realtime_pcm()
    heard16k = StreamResampler(24000, 16000).feed(pcm.astype(np.float32) / 32768.0)  # as the session hears it
    prompt = (chat("<|audio_bos|><|AUDIO|><|audio_eos|>"), {"audio": (heard16k, 16000)})
    want_ids, _, _ = reference_run(reference, prompt)
    want_text = reference[1].tokenizer.decode(want_ids, skip_special_tokens=True)
    want = reference_wav(reference, reference_codes(reference, prompt, "Chelsie"), "Chelsie")
    async with aclient(server).realtime.connect(model=SERVED) as conn:
        created = await conn.recv()
        assert created.session.audio.input.transcription is None
        assert created.session.audio.output.voice == "Chelsie"
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "transcription": {"model": "whisper-1"}}}})
        refused = await events_until(conn, "error")
        assert refused[-1][1].error.param == "session.audio.input.transcription"
        assert "no speech-to-text stage" in refused[-1][1].error.message
        await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS,
                                           "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated")
        await conn.input_audio_buffer.append(audio=b64.b64encode(pcm.tobytes()).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await events_until(conn, "response.done")
        done = events[-1][1].response
        # transformers' answer too stops at the token limit or ends before it
        assert done.status == ("incomplete" if len(want_ids) == MAX_TOKENS else "completed"), done.status_details
        transcript = "".join(ev.delta for ev in of_type(events, "response.output_audio_transcript.delta"))
        assert transcript == want_text
        audio = answer_audio(events)
        assert audio.shape == want.shape
        np.testing.assert_allclose(audio, np.clip(want, -1, 1), atol=1e-4 + 2 * PCM16_STEP, rtol=0)
    assert not of_type(events, "conversation.item.input_audio_transcription.failed")


def _realtime_pcm() -> np.ndarray:
    """The tone of the audio chat tests, 24 kHz int16 (the realtime input format)."""
    from omni_engine.realtime.audio_io import StreamResampler

    samples = tone()
    resampled = StreamResampler(16000, 24000).feed(samples)
    return (np.clip(resampled, -1, 1) * 32767).astype("<i2")
