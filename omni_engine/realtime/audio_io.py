"""Audio on a realtime session's wire: base64 PCM16 at 24 kHz or G.711 at 8 kHz, resampled as it streams.

Input audio is decoded to float32 and resampled to 16 kHz (what the VAD and Whisper take) chunk
by chunk with a *stateful* resampler, so 20 ms chunks give the same samples as one block would
(no clicks at chunk edges). Output audio (the speech stage's rate, 22.05 kHz for Piper) is
resampled to the session's output rate the same way, one resampler per response.
"""

from __future__ import annotations

import base64
import binascii

import av
import numpy as np

from omni_engine.realtime.config import FORMAT_RATES

# OpenAI's limit on one input_audio_buffer.append.
MAX_APPEND_BYTES = 15 * 1024 * 1024
# One output delta carries at most this much audio: a long sentence in one frame could pass a client's
# frame limit (1 MiB by default in ``websockets``; 20 s of pcm16 at 24 kHz is 1.3 MB of base64).
DELTA_MS = 1000


class AudioInputError(ValueError):
    """Audio that cannot be decoded in the session's format; the message says why."""


def _ulaw_table() -> np.ndarray:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent, mantissa = (codes >> 4) & 0x07, codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32) / 32768.0


def _alaw_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    exponent, mantissa = (codes >> 4) & 0x07, codes & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(codes & 0x80, magnitude, -magnitude).astype(np.float32) / 32768.0


_DECODE = {"audio/pcmu": _ulaw_table(), "audio/pcma": _alaw_table()}


def _g711_encode(samples: np.ndarray, fmt: str) -> bytes:
    """Nearest G.711 code per sample (tables are monotonic within each sign, so a search finds it)."""
    table = _DECODE[fmt]
    order = np.argsort(table, kind="stable")
    values = table[order]
    x = np.clip(samples, -1.0, 1.0)
    idx = np.clip(np.searchsorted(values, x), 1, len(values) - 1)
    nearer = np.where(np.abs(values[idx - 1] - x) <= np.abs(values[idx] - x), idx - 1, idx)
    return order[nearer].astype(np.uint8).tobytes()


def decode_input(data: str, fmt: str) -> np.ndarray:
    """Base64 ``data`` in ``fmt`` as float32 samples at the format's rate."""
    if not isinstance(data, str):
        raise AudioInputError("audio must be a base64 string")
    if len(data) > MAX_APPEND_BYTES * 4 // 3 + 4:
        raise AudioInputError(f"audio is larger than {MAX_APPEND_BYTES // 2**20} MiB; append it in smaller chunks")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise AudioInputError("audio is not valid base64") from None
    if fmt == "audio/pcm":
        if len(raw) % 2:
            raise AudioInputError(f"audio/pcm is 16-bit samples: {len(raw)} bytes is not a whole number of samples")
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    return _DECODE[fmt][np.frombuffer(raw, dtype=np.uint8)]


def encode_output(samples: np.ndarray, fmt: str) -> str:
    """float32 ``samples`` (already at the format's rate) as base64 in ``fmt``."""
    if fmt == "audio/pcm":
        raw = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    else:
        raw = _g711_encode(np.asarray(samples, dtype=np.float32), fmt)
    return base64.b64encode(raw).decode("ascii")


class StreamResampler:
    """float32 mono from ``in_rate`` to ``out_rate``, chunk by chunk, with the filter's state kept between chunks."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate, self.out_rate = in_rate, out_rate
        self._resampler = None if in_rate == out_rate else av.AudioResampler(format="flt", layout="mono", rate=out_rate)
        self._pts = 0

    def feed(self, samples: np.ndarray) -> np.ndarray:
        if self._resampler is None or len(samples) == 0:
            return np.asarray(samples, dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32).reshape(1, -1),
                                           format="flt", layout="mono")
        frame.sample_rate = self.in_rate
        frame.pts = self._pts
        self._pts += len(samples)
        return self._collect(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """What the filter still holds (the end of the stream)."""
        if self._resampler is None:
            return np.zeros(0, dtype=np.float32)
        return self._collect(self._resampler.resample(None))

    @staticmethod
    def _collect(frames: list) -> np.ndarray:
        parts = [f.to_ndarray().reshape(-1) for f in frames]
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, dtype=np.float32)


def rate_of(fmt: str) -> int:
    return FORMAT_RATES[fmt]
