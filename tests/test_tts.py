"""eSpeak NG speech synthesis, end to end against the real library (no mocks)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from omni_engine.engines.generation_model import GenerationModel, GenerationRequest
from omni_engine.engines.tts import EspeakSynthesizer, EspeakTTSModel, make_espeak_tts
from omni_engine.params import SpeechParams

pytestmark = pytest.mark.tts

TEXT = "Hello world. This is a test."


@pytest.fixture(scope="module")
def synth():
    s = EspeakSynthesizer()
    yield s
    s.close()


@pytest.fixture
async def model():
    m = make_espeak_tts()
    yield m
    await m.shutdown()


def _rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))


def test_synthesizes_audible_speech(synth: EspeakSynthesizer) -> None:
    audio = synth.synthesize(TEXT, SpeechParams())
    assert synth.sample_rate == 22050
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert 1.0 < len(audio) / synth.sample_rate < 5.0
    assert _rms(audio) > 0.01
    assert np.abs(audio).max() <= 1.0


def test_speed_changes_duration(synth: EspeakSynthesizer) -> None:
    fast = synth.synthesize(TEXT, SpeechParams(speed=2.0))
    slow = synth.synthesize(TEXT, SpeechParams(speed=0.5))
    assert len(fast) * 2 < len(slow)


def _trailing_silence_s(audio: np.ndarray, sample_rate: int) -> float:
    loud = np.nonzero(np.abs(audio) > 0.01)[0]
    return (len(audio) - loud[-1]) / sample_rate


@pytest.mark.parametrize("speed", [1.0, 1.5])
def test_speech_made_sentence_by_sentence_keeps_the_pauses_of_the_whole(synth: EspeakSynthesizer, speed) -> None:
    """Streamed speech and an LLM's answer are spoken a sentence (or a first clause) at a time: the
    pieces, one after the other, last as long as the whole text spoken at once (eSpeak's pause after
    a sentence or a comma is kept); a piece cut inside a clause ends without a pause."""
    params, rate = SpeechParams(speed=speed), synth.sample_rate
    first, comma, rest = "The weather today is sunny and warm.", "We will meet at the library,", "after lunch."
    whole = synth.synthesize(f"{first} {comma} {rest}", params)
    pieces = [synth.synthesize(text, params) for text in (first, comma, rest)]
    lost = (len(whole) - sum(map(len, pieces))) / rate
    assert abs(lost) < 0.03, f"the pieces are {lost:.3f} s shorter than the whole"
    # Sentence > comma > none (at 1x: 0.31 s, 0.15 s, ~0.01 s).
    cut = synth.synthesize("The weather today is", params)
    ends = [_trailing_silence_s(audio, rate) for audio in (pieces[0], pieces[1], cut)]
    assert ends[0] > ends[1] > 0.05 > ends[2], ends


def _median_f0(audio: np.ndarray, sample_rate: int) -> float:
    """Median fundamental frequency of the loud frames, by autocorrelation (60..400 Hz)."""
    frame, lo, hi = 1024, sample_rate // 400, sample_rate // 60
    f0s = []
    for start in range(0, len(audio) - frame, frame):
        x = audio[start : start + frame].astype(np.float64)
        if _rms(x) > 0.05:
            ac = np.correlate(x, x, "full")[frame - 1 :]
            f0s.append(sample_rate / (lo + int(np.argmax(ac[lo:hi]))))
    return float(np.median(f0s))


def test_pitch_raises_fundamental_frequency(synth: EspeakSynthesizer) -> None:
    sr = synth.sample_rate
    low = _median_f0(synth.synthesize(TEXT, SpeechParams(pitch=0)), sr)
    high = _median_f0(synth.synthesize(TEXT, SpeechParams(pitch=100)), sr)
    assert high > 1.5 * low


def test_settings_do_not_leak_between_calls(synth: EspeakSynthesizer) -> None:
    # eSpeak output varies by a few samples from run to run, so compare with tolerances.
    sr = synth.sample_rate
    baseline = synth.synthesize(TEXT, SpeechParams())
    synth.synthesize(TEXT, SpeechParams(speed=3.0, pitch=100, voice="de"))
    again = synth.synthesize(TEXT, SpeechParams())
    assert abs(len(again) - len(baseline)) < 0.01 * len(baseline)
    assert _median_f0(again, sr) == pytest.approx(_median_f0(baseline, sr), rel=0.1)


def test_blank_text_gives_empty_audio(synth: EspeakSynthesizer) -> None:
    for text in ("", "  \n\t"):
        audio = synth.synthesize(text, SpeechParams())
        assert audio.dtype == np.float32 and audio.shape == (0,)


def test_unknown_voice_is_value_error(synth: EspeakSynthesizer) -> None:
    with pytest.raises(ValueError, match="unknown voice 'xx'"):
        synth.synthesize(TEXT, SpeechParams(voice="xx"))


@pytest.mark.parametrize("speed", [0.0, 0.2, 4.5, float("nan")])
def test_invalid_speed_is_value_error(synth: EspeakSynthesizer, speed: float) -> None:
    with pytest.raises(ValueError, match="speed"):
        synth.synthesize(TEXT, SpeechParams(speed=speed))


@pytest.mark.parametrize("pitch", [-1, 101])
def test_invalid_pitch_is_value_error(pitch: int) -> None:
    with pytest.raises(ValueError, match="pitch"):
        SpeechParams(pitch=pitch).validate()


def test_every_listed_voice_is_selectable(synth: EspeakSynthesizer) -> None:
    voices = synth.list_voices()
    assert {"en", "en-gb", "en-us", "de", "zh", "chr"} <= set(voices)
    for voice in voices:
        synth.check_voice(voice)
    synth.check_voice("English (America)")  # names work too


def test_language_code_selects_matching_voice(synth: EspeakSynthesizer) -> None:
    # "en-gb" is not a voice-file name; it must resolve by language, not fail.
    assert _rms(synth.synthesize(TEXT, SpeechParams(voice="en-gb"))) > 0.01


def test_non_ascii_text(synth: EspeakSynthesizer) -> None:
    audio = synth.synthesize("Grüße aus Köln, schönes Wetter heute.", SpeechParams(voice="de"))
    assert _rms(audio) > 0.01


async def test_model_satisfies_protocol(model: EspeakTTSModel) -> None:
    assert isinstance(model, GenerationModel)
    assert model.output_type == "audio"
    info = model.info()
    assert info["sample_rate"] == 22050 and info["engine"] == "espeak-ng" and len(info["voices"]) > 50


async def test_batch_isolates_a_bad_request(model: EspeakTTSModel) -> None:
    requests = [
        GenerationRequest("a", TEXT),
        GenerationRequest("b", {"prompt": TEXT}, params={"voice": "nope"}),
        GenerationRequest("c", TEXT, params=SpeechParams(speed=1.5)),
    ]
    results = await model.generate(requests)
    assert len(results) == 3
    assert isinstance(results[1], ValueError) and "nope" in str(results[1])
    for result in (results[0], results[2]):
        assert isinstance(result, dict) and result["sample_rate"] == 22050
        assert result["audio"].dtype == np.float32 and _rms(result["audio"]) > 0.01
    assert len(results[2]["audio"]) < len(results[0]["audio"])


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        (TEXT, {"sped": 2.0}, "sped"),
        (TEXT, {"speed": 9.0}, "speed"),
        (42, None, "prompt"),
        ({"text": TEXT}, None, "prompt"),
    ],
)
async def test_bad_request_fails_alone(model: EspeakTTSModel, prompt: object, params: object, needle: str) -> None:
    bad, good = await model.generate([GenerationRequest("bad", prompt, params), GenerationRequest("ok", TEXT)])
    assert isinstance(bad, Exception) and needle in str(bad)
    assert isinstance(good, dict)


async def test_aborted_request_is_skipped(model: EspeakTTSModel) -> None:
    aborted = GenerationRequest("x", TEXT, aborted=True)
    result, ok = await model.generate([aborted, GenerationRequest("y", TEXT)])
    assert isinstance(result, RuntimeError) and str(result) == "aborted"
    assert isinstance(ok, dict)


async def test_event_loop_stays_responsive(model: EspeakTTSModel) -> None:
    long_text = " ".join(f"Sentence number {i} of a fairly long passage." for i in range(60))
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start_ticks, start = ticks, time.perf_counter()
    [result] = await model.generate([GenerationRequest("long", long_text)])
    elapsed = time.perf_counter() - start
    done = True
    await task
    assert isinstance(result, dict) and len(result["audio"]) / result["sample_rate"] > 60
    assert elapsed > 0.05  # long enough that a blocked loop would have starved the ticker
    assert ticks - start_ticks > 20


async def test_abort_stops_a_running_synthesis(model: EspeakTTSModel) -> None:
    # ~1.5 s of work and ~20 minutes of audio if the abort were ignored.
    request = GenerationRequest("long", " ".join(f"Sentence number {i} of a long passage." for i in range(400)))
    asyncio.get_running_loop().call_later(0.02, setattr, request, "aborted", True)
    start = time.perf_counter()
    [result] = await model.generate([request])
    assert isinstance(result, RuntimeError) and str(result) == "aborted"
    assert time.perf_counter() - start < 0.75


async def test_shutdown_is_idempotent() -> None:
    m = EspeakTTSModel()
    await m.shutdown()
    await m.shutdown()
    with pytest.raises(RuntimeError):
        await m.generate([GenerationRequest("late", TEXT)])


def test_closing_one_synthesizer_keeps_others_working(synth: EspeakSynthesizer) -> None:
    # eSpeak is process-global; terminating it under a live instance would segfault.
    other = EspeakSynthesizer()
    other.close()
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        other.synthesize(TEXT, SpeechParams())
    assert _rms(synth.synthesize(TEXT, SpeechParams())) > 0.01


def test_factory_rejects_unknown_keyword() -> None:
    with pytest.raises(TypeError, match="bogus"):
        make_espeak_tts(bogus=1)


def test_bad_default_voice_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="zz-zz"):
        make_espeak_tts(default_voice="zz-zz")


OPENAI_VOICE_NAMES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse")


async def test_openai_voices_are_distinct_engine_voices(model: EspeakTTSModel) -> None:
    from omni_engine.engines.tts import OPENAI_VOICES

    assert set(OPENAI_VOICES) == set(OPENAI_VOICE_NAMES)
    assert len(set(OPENAI_VOICES.values())) == len(OPENAI_VOICES)  # each its own voice
    requests = [GenerationRequest(name, TEXT, params={"voice": name.upper() if name == "alloy" else name})
                for name in OPENAI_VOICE_NAMES]
    results = await model.generate(requests)
    audio = {}
    for name, result in zip(OPENAI_VOICE_NAMES, results):
        assert not isinstance(result, Exception), (name, result)
        assert _rms(result["audio"]) > 0.01, name
        audio[name] = result["audio"]
    # Different voices sound different: no two renderings are the same samples.
    renderings = {a.tobytes() for a in audio.values()}
    assert len(renderings) == len(OPENAI_VOICE_NAMES)
    assert model.info()["voice_map"]["alloy"] == OPENAI_VOICES["alloy"]


async def test_voice_map_overrides_and_bad_entries_fail_the_start() -> None:
    model = make_espeak_tts(voice_map={"alloy": "en-gb", "narrator": "en-us+m2"})
    try:
        assert model.resolve_voice("alloy") == "en-gb" and model.resolve_voice("Narrator") == "en-us+m2"
        assert model.resolve_voice("echo") == "en-us+m1"  # the rest of the default table stays
        [result] = await model.generate([GenerationRequest("n", TEXT, params={"voice": "narrator"})])
        assert _rms(result["audio"]) > 0.01
    finally:
        await model.shutdown()
    with pytest.raises(ValueError, match=r"voice_map\['robot'\]: unknown voice variant 'nosuch'"):
        make_espeak_tts(voice_map={"robot": "en+nosuch"})
    with pytest.raises(ValueError, match=r"voice_map\['x'\]: unknown voice 'no-such-voice'"):
        make_espeak_tts(voice_map={"x": "no-such-voice"})
