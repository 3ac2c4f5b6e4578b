"""``omni-engine serve`` of stage_configs/smollm2_piper.yaml: OpenAI's speech and chat-audio routes speak
with the Piper voice (SmolLM2 -> phonemizer -> VITS), through the official ``openai`` client."""

from __future__ import annotations

import base64
import io
import json
import urllib.request
import wave

import numpy as np
import openai
import pytest

from tests.serve_helpers import openai_client, running_server

pytestmark = pytest.mark.llm

MODEL = "smollm2-piper"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    with running_server("stage_configs/smollm2_piper.yaml", MODEL, tmp_path_factory.mktemp("serve-piper")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def wav_seconds(data: bytes) -> float:
    """Seconds of a 22.05 kHz mono 16-bit WAV that is not silence."""
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2") / 32768.0
    assert float(np.sqrt(np.mean(samples ** 2))) > 0.01
    return len(samples) / 22050


def test_speech_is_spoken_by_the_piper_voice(client):
    response = client.audio.speech.create(model=MODEL, voice="alloy", input="Hello there. How are you today?",
                                          response_format="wav")
    assert 1.0 < wav_seconds(response.content) < 6.0


def test_chat_audio_speaks_the_answer(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                              modalities=["text", "audio"], audio={"voice": "en", "format": "wav"})
    message = response.choices[0].message
    assert "Paris" in message.content and "Paris" in message.audio.transcript
    assert wav_seconds(base64.b64decode(message.audio.data)) > 1.0


def test_voices_are_the_piper_speakers_and_an_unknown_one_is_a_400(server, client):
    with urllib.request.urlopen(f"{server['url']}/v1/audio/voices", timeout=10) as response:
        voices = json.load(response)["data"]
    assert {"id": "joe", "object": "voice", "kind": "engine"} in voices
    assert {v["engine_voice"] for v in voices if v["kind"] == "openai"} == {"joe"}
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model=MODEL, voice="nobody", input="Hi.", response_format="wav")
    assert "'nobody'" in str(bad.value) and "/v1/audio/voices" in str(bad.value)
