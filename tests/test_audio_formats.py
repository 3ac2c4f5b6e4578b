"""OpenAI's audio formats, encoded by FFmpeg through PyAV and decoded back with it (no server)."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from omni_engine.audio import SPEECH_FORMATS, AudioFormatError, check_format, encode_audio, media_type

RATE = 22050


def tone(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().astype(np.float64).reshape(-1) for f in container.decode(stream)]
        rate = stream.rate
    samples = np.concatenate(frames)
    return (samples / 32768.0 if np.abs(samples).max() > 2 else samples), rate


@pytest.mark.parametrize("fmt, rate, media", [("mp3", RATE, "audio/mpeg"), ("opus", 48000, "audio/ogg"),
                                              ("aac", RATE, "audio/aac"), ("flac", RATE, "audio/flac")])
def test_each_compressed_format_decodes_back_to_the_same_sound(fmt, rate, media):
    data = encode_audio(tone(1.0), RATE, fmt)
    samples, got_rate = decode(data)
    assert got_rate == rate and media_type(fmt) == media
    assert abs(len(samples) / got_rate - 1.0) < 0.1  # codec priming/padding only
    assert abs(float(np.sqrt(np.mean(samples ** 2))) - 0.3 / np.sqrt(2)) < 0.03  # the tone's loudness


def test_wav_and_pcm_are_written_here():
    audio = tone(0.5)
    with wave.open(io.BytesIO(encode_audio(audio, RATE, "wav"))) as w:
        assert (w.getframerate(), w.getnframes()) == (RATE, len(audio))
    assert len(encode_audio(audio, RATE, "pcm")) == 2 * len(audio)
    assert SPEECH_FORMATS[0] == "mp3"  # OpenAI's default first


def test_empty_audio_encodes():
    for fmt in SPEECH_FORMATS:
        encode_audio(np.zeros(0, dtype=np.float32), RATE, fmt)


def test_unknown_format_is_named():
    with pytest.raises(AudioFormatError, match="'vorbis'"):
        check_format("vorbis")


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_a_stream_fed_piece_by_piece_decodes_to_the_file_made_at_once(fmt):
    """What ``/v1/audio/speech`` sends as each piece is spoken is, decoded, the file a whole answer
    would be: same samples, though the sizes a muxer rewrites at the end (WAV, FLAC) could not be."""
    from omni_engine.audio import AudioStreamEncoder

    pieces = [tone(0.37), tone(0.81)[::-1].copy(), tone(0.05), tone(1.23)]
    encoder = AudioStreamEncoder(fmt, RATE)
    sent = [encoder.feed(piece) for piece in pieces] + [encoder.close()]
    assert sum(1 for data in sent[:-1] if data) >= (2 if fmt in ("wav", "pcm", "flac") else 1)
    streamed, whole = b"".join(sent), encode_audio(np.concatenate(pieces), RATE, fmt)
    assert len(streamed) == len(whole)
    if fmt == "pcm":
        assert streamed == whole
        return
    if fmt == "wav":  # only the sizes differ: unknown (0xFFFFFFFF) when the header left
        assert streamed[:4] + streamed[8:40] + streamed[44:] == whole[:4] + whole[8:40] + whole[44:]
        assert streamed[4:8] == streamed[40:44] == b"\xff\xff\xff\xff"
    got, rate = decode(streamed)
    expected, expected_rate = decode(whole)
    assert rate == expected_rate
    if fmt == "mp3":
        # The same frames; a stream cannot have the gapless tag (filled at the end), so a decoder
        # keeps the encoder's priming samples in front: the whole file's samples follow them.
        assert 0 < len(got) - len(expected) <= 2 * 1152
        assert any(np.array_equal(got[k:k + len(expected)], expected) for k in range(0, 2 * 1152 + 1))
    else:
        assert np.array_equal(got, expected)
