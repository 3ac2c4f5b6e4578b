"""Audio helpers: float waveforms to WAV, raw PCM, and OpenAI's compressed formats.

WAV and PCM are written here; mp3, opus (in Ogg), aac (ADTS) and flac are
encoded by FFmpeg through PyAV (``av``, in the ``tts`` extra), never by hand.
A format no installed library can produce is an ``AudioFormatError`` naming it.
"""

from __future__ import annotations

import io
import struct
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class AudioFormatError(ValueError):
    """An audio format that cannot be produced here; the message names it."""


@dataclass(frozen=True)
class EncodedFormat:
    """How PyAV writes one of OpenAI's compressed formats."""

    container: str
    codec: str
    media_type: str
    # Sample rates the codec takes (None: any); other rates are resampled to the first.
    rates: tuple[int, ...] | None = None


ENCODED_FORMATS: dict[str, EncodedFormat] = {
    "mp3": EncodedFormat("mp3", "libmp3lame", "audio/mpeg"),
    "opus": EncodedFormat("ogg", "libopus", "audio/ogg", (48000, 24000, 16000, 12000, 8000)),
    "aac": EncodedFormat("adts", "aac", "audio/aac"),
    "flac": EncodedFormat("flac", "flac", "audio/flac"),
}
PCM_MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
# OpenAI's speech API formats, its default (mp3) first.
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


def pcm16(audio: np.ndarray) -> np.ndarray:
    """Mono float32 in [-1, 1] as 16-bit little-endian samples."""
    return (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")


def wav_float_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """Mono float32 as a 32-bit IEEE-float WAV file: lossless (the stdlib ``wave`` writes PCM only)."""
    data = np.ascontiguousarray(audio, dtype="<f4").tobytes()
    rate = int(sample_rate)
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)  # WAVE_FORMAT_IEEE_FLOAT, mono
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """Mono float32 in [-1, 1] as a 16-bit PCM WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm16(audio).tobytes())
    return buf.getvalue()


# A streamed WAV's sizes are not known when its header is sent: RIFF's and data's say "as much as
# follows" (0xFFFFFFFF), as streaming servers (OpenAI's among them) send them; readers take it.
UNKNOWN_SIZE = 0xFFFFFFFF


def wav_stream_header(sample_rate: int) -> bytes:
    """The 44-byte header of a 16-bit mono WAV of unknown length (``wav_bytes``'s, sizes aside)."""
    rate = int(sample_rate)
    fmt_chunk = struct.pack("<IHHIIHH", 16, 1, 1, rate, 2 * rate, 2, 16)  # PCM, mono, 16 bits
    unknown = struct.pack("<I", UNKNOWN_SIZE)
    return b"RIFF" + unknown + b"WAVEfmt " + fmt_chunk + b"data" + unknown


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wav_bytes(audio, sample_rate))
    return path


def media_type(fmt: str) -> str:
    return PCM_MEDIA_TYPES.get(fmt) or ENCODED_FORMATS[fmt].media_type


def check_format(fmt: str) -> None:
    """``AudioFormatError`` unless ``fmt`` can be produced here."""
    if fmt in PCM_MEDIA_TYPES:
        return
    spec = ENCODED_FORMATS.get(fmt)
    if spec is None:
        raise AudioFormatError(f"audio format {fmt!r} is not supported; use one of {list(SPEECH_FORMATS)}")
    try:
        import av
    except ImportError:
        raise AudioFormatError(f"audio format {fmt!r} needs PyAV (pip install av, or the tts extra); "
                               f"without it only {sorted(PCM_MEDIA_TYPES)} are available") from None
    try:
        av.codec.Codec(spec.codec, "w")
    except Exception:  # noqa: BLE001 - PyAV raises its own error types per version
        raise AudioFormatError(f"audio format {fmt!r}: this FFmpeg build has no {spec.codec} encoder") from None


def encode_audio(audio: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Mono float32 in [-1, 1] as a file (or raw PCM) of format ``fmt``."""
    if fmt == "wav":
        return wav_bytes(audio, sample_rate)
    if fmt == "pcm":
        return pcm16(audio).tobytes()
    encoder = AudioStreamEncoder(fmt, sample_rate)  # checks the format
    encoder.feed(audio)
    encoder.close()
    return encoder.whole()


class AudioStreamEncoder:
    """One continuous stream of ``fmt`` fed a piece of audio at a time (a sentence as it is spoken).

    ``feed`` and ``close`` return the bytes ready to send; ``whole`` is the
    complete file after ``close`` (with the headers a muxer rewrites at the
    end, which a stream sent as it goes cannot have: its length is unknown).
    Concatenated, what ``feed`` and ``close`` return is ``encode_audio`` of all the audio but for
    those headers: WAV's sizes (``wav_stream_header``), FLAC's STREAMINFO, MP3's gapless tag.
    """

    def __init__(self, fmt: str, sample_rate: int) -> None:
        self.fmt, self.sample_rate = fmt, int(sample_rate)
        self._buf = io.BytesIO()
        self._sent = 0
        if fmt in PCM_MEDIA_TYPES:
            self._head = wav_stream_header(self.sample_rate) if fmt == "wav" else b""
            return
        import av

        spec = ENCODED_FORMATS[fmt]
        check_format(fmt)
        rate = self.sample_rate if spec.rates is None or self.sample_rate in spec.rates else spec.rates[0]
        self._av = av
        self._out = av.open(self._buf, "w", format=spec.container)
        self._stream = self._out.add_stream(spec.codec, rate=rate, layout="mono")
        # The encoder's own sample format and rate; PyAV re-frames to its frame size.
        self._resampler = av.AudioResampler(format=self._stream.codec_context.format.name, layout="mono", rate=rate)

    def feed(self, audio: np.ndarray) -> bytes:
        samples = pcm16(audio)
        if self.fmt in PCM_MEDIA_TYPES:
            head, self._head = self._head, b""
            return head + samples.tobytes()
        if len(samples):
            frame = self._av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
            frame.sample_rate = self.sample_rate
            self._encode(self._resampler.resample(frame))
        return self._drain()

    def close(self) -> bytes:
        if self.fmt in PCM_MEDIA_TYPES:
            head, self._head = self._head, b""
            return head  # (a stream with no audio at all is still a WAV)
        self._encode(self._resampler.resample(None))
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        return self._drain()

    def whole(self) -> bytes:
        """The compressed file (``encode_audio``'s); WAV and PCM are written by ``encode_audio`` itself."""
        return self._buf.getvalue()

    def _encode(self, frames: list) -> None:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._out.mux(packet)

    def _drain(self) -> bytes:
        with self._buf.getbuffer() as view:
            data = bytes(view[self._sent:])
        self._sent += len(data)
        return data


# Whisper's input rate: uploads are decoded to it on the server, so the samples cross once, ready.
WHISPER_SAMPLE_RATE = 16000


class AudioDecodeError(ValueError):
    """Bytes that are not audio FFmpeg can decode (the message says what was found)."""


# An upload is decoded whole; a limit on its decoded length keeps a small compressed file from
# expanding into gigabytes of samples.
MAX_DECODED_S = 3600.0


def decode_audio(data: bytes, sample_rate: int, max_seconds: float = MAX_DECODED_S) -> np.ndarray:
    """Mono float32 samples at ``sample_rate`` from an encoded file (wav, mp3, flac, ogg, m4a, webm...).

    FFmpeg (through PyAV) probes the container, so the file's name or declared type does not
    matter; its first audio stream is mixed down and resampled. ``AudioDecodeError`` says why a
    file cannot be used (not audio, no audio stream, too long).
    """
    import av

    if not data:
        raise AudioDecodeError("the file is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as exc:
        raise AudioDecodeError(f"the file is not audio FFmpeg can decode ({exc})") from None
    with container:
        if not container.streams.audio:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise AudioDecodeError(f"the file has no audio stream (streams: {', '.join(kinds)})")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
        limit = int(max_seconds * sample_rate)
        chunks, total = [], 0
        try:
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if total > limit:
                    raise AudioDecodeError(f"the audio is longer than {max_seconds:.0f} s")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
        except av.error.FFmpegError as exc:
            raise AudioDecodeError(f"the audio stream cannot be decoded ({exc})") from None
    samples = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    if not samples.size:
        raise AudioDecodeError("the file holds no audio samples")
    return samples
