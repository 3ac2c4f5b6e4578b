"""Server VAD (``omni_engine.realtime.vad``): the real Silero model on real speech from eSpeak NG.

eSpeak's output varies slightly between syntheses, so each phrase is synthesized once and positions
are checked with tolerances; the same arrays give exact equality only where the audio is identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from omni_engine.audio import decode_audio, wav_bytes
from omni_engine.engines.tts import EspeakSynthesizer
from omni_engine.params import SpeechParams
from omni_engine.realtime.vad import SpeechEvent, SpeechEventKind, VadConfig, VoiceActivityDetector

RATE = 16000
TOL = int(0.150 * RATE)  # ±150 ms
STARTED, STOPPED = SpeechEventKind.STARTED, SpeechEventKind.STOPPED


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def bounds(audio: np.ndarray) -> tuple[int, int]:
    """First and last sample of audible speech (eSpeak pads a little silence around it)."""
    loud = np.flatnonzero(np.abs(audio) > 0.02)
    return int(loud[0]), int(loud[-1]) + 1


@pytest.fixture(scope="module")
def phrases() -> tuple[np.ndarray, np.ndarray]:
    tts = EspeakSynthesizer()
    out = []
    for text in ("Hello there, how are you doing today?", "The weather is lovely this morning."):
        audio = tts.synthesize(text, SpeechParams(voice="en"))
        out.append(decode_audio(wav_bytes(audio, tts.sample_rate), RATE))
    return out[0], out[1]


@pytest.fixture(scope="module")
def dialogue(phrases):
    """0.5 s silence, phrase A, 1 s silence, phrase B, 2 s silence; with A's and B's speech bounds."""
    a, b = phrases
    parts = [silence(0.5), a, silence(1.0), b, silence(2.0)]
    a0 = len(parts[0])
    b0 = a0 + len(a) + len(parts[2])
    (sa, ea), (sb, eb) = bounds(a), bounds(b)
    return np.concatenate(parts), [(a0 + sa, a0 + ea), (b0 + sb, b0 + eb)]


def run(audio: np.ndarray, chunk: int | None = None, **config) -> list[SpeechEvent]:
    vad = VoiceActivityDetector(VadConfig(**config))
    if chunk is None:
        events = vad.feed(audio)
    else:
        events = [e for i in range(0, len(audio), chunk) for e in vad.feed(audio[i:i + chunk])]
    assert vad.samples_seen == len(audio)
    return events


def pairs(events: list[SpeechEvent]) -> list[tuple[int, int]]:
    """(started, stopped) offsets; the kinds must alternate, starting with started."""
    assert [e.kind for e in events] == [STARTED, STOPPED] * (len(events) // 2) and len(events) % 2 == 0, events
    return [(events[i].sample, events[i + 1].sample) for i in range(0, len(events), 2)]


def test_silence_and_faint_noise_are_not_speech():
    assert run(silence(5.0)) == []
    noise = np.random.default_rng(0).normal(0.0, 0.005, 10 * RATE).astype(np.float32)
    vad = VoiceActivityDetector(VadConfig())
    assert vad.feed(noise) == [] and not vad.speaking


def test_two_turns(dialogue):
    audio, speech = dialogue
    got = pairs(run(audio, prefix_padding_ms=300, silence_duration_ms=500))
    assert len(got) == 2, got
    for (started, stopped), (onset, end) in zip(got, speech):
        assert abs(started - (onset - 300 * RATE // 1000)) <= TOL, (started, onset)
        assert abs(stopped - (end + 500 * RATE // 1000)) <= TOL, (stopped, end)
    # Each turn's audio ends before the next one's begins.
    assert got[0][1] <= got[1][0]


def test_silence_longer_than_the_gap_keeps_one_turn(dialogue):
    audio, speech = dialogue
    got = pairs(run(audio, silence_duration_ms=1500))
    assert len(got) == 1, got
    assert abs(got[0][0] - (speech[0][0] - 300 * RATE // 1000)) <= TOL
    assert abs(got[0][1] - (speech[1][1] + 1500 * RATE // 1000)) <= TOL


def test_prefix_padding_clamps_at_zero(phrases):
    audio = np.concatenate([phrases[0], silence(1.0)])
    events = run(audio, prefix_padding_ms=300)
    assert events[0] == SpeechEvent(STARTED, 0)
    # No padding: the onset itself, on a frame boundary.
    onset = run(np.concatenate([silence(0.5), audio]), prefix_padding_ms=0)[0].sample
    assert onset % VoiceActivityDetector.FRAME == 0
    assert abs(onset - (len(silence(0.5)) + bounds(phrases[0])[0])) <= TOL


def test_chunking_does_not_change_events(dialogue):
    audio = dialogue[0]
    whole = run(audio)
    assert len(whole) == 4
    assert run(audio, chunk=320) == whole   # 20 ms
    assert run(audio, chunk=7) == whole
    assert run(audio, chunk=VoiceActivityDetector.FRAME * 3 + 1) == whole


def test_feed_accepts_empty_and_keeps_the_remainder():
    vad = VoiceActivityDetector(VadConfig())
    assert vad.feed(np.zeros(0, dtype=np.float32)) == []
    assert vad.feed(silence(0.01)) == [] and vad.samples_seen == 160
    assert vad.feed(np.zeros(0, dtype=np.float32)) == [] and vad.samples_seen == 160


def test_reset_starts_a_fresh_stream(dialogue):
    audio = dialogue[0]
    vad = VoiceActivityDetector(VadConfig())
    first = vad.feed(audio[: len(audio) // 3])   # stops mid-turn: state, remainder and counters in use
    assert first and first[-1].kind == STARTED and vad.speaking
    vad.reset()
    assert vad.samples_seen == 0 and not vad.speaking
    assert vad.feed(audio) == run(audio)


def test_higher_threshold_detects_later(dialogue):
    audio = dialogue[0]
    low, high = pairs(run(audio, threshold=0.5)), pairs(run(audio, threshold=0.999))
    # eSpeak's speech is so clearly speech that even 0.999 finds both turns, but the onsets come
    # at least one frame later, where the model's probability has climbed past 0.999.
    assert len(high) == len(low) == 2
    for (s_high, _), (s_low, _) in zip(high, low):
        assert s_high >= s_low + VoiceActivityDetector.FRAME


def test_matches_silero_onnx_wrapper_and_its_timestamps(dialogue):
    import torch  # silero's own wrapper needs it (vad.py does not)
    from silero_vad import load_silero_vad
    from silero_vad.utils_vad import get_speech_timestamps_from_probs

    audio = dialogue[0]
    frame = VoiceActivityDetector.FRAME
    model = load_silero_vad(onnx=True)
    n = len(audio) // frame
    theirs = [float(model(torch.from_numpy(audio[i * frame:(i + 1) * frame].copy()), RATE)) for i in range(n)]
    vad = VoiceActivityDetector(VadConfig())
    ours = [vad.speech_probability(audio[i * frame:(i + 1) * frame]) for i in range(n)]
    assert np.max(np.abs(np.array(ours) - np.array(theirs))) < 1e-5

    # The turns equal silero's own segmentation of those probabilities (no padding, no minimum speech).
    segments = get_speech_timestamps_from_probs(theirs, RATE, threshold=0.5, min_speech_duration_ms=0,
                                                min_silence_duration_ms=500, speech_pad_ms=0)
    got = pairs(run(audio, threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500))
    assert [(s + 300 * RATE // 1000, e - 500 * RATE // 1000) for s, e in got] == \
        [(seg["start"], seg["end"]) for seg in segments]


@pytest.mark.parametrize(("field", "config"), [
    ("threshold", VadConfig(threshold=1.5)),
    ("threshold", VadConfig(threshold=-0.1)),
    ("prefix_padding_ms", VadConfig(prefix_padding_ms=-1)),
    ("silence_duration_ms", VadConfig(silence_duration_ms=-20)),
])
def test_config_validation_names_the_field(field, config):
    with pytest.raises(ValueError, match=rf"turn_detection\.{field} "):
        config.validate()
    with pytest.raises(ValueError, match=field):
        VoiceActivityDetector(config)
    VadConfig().validate()
