"""Audio helpers: float waveforms to WAV bytes/files."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """Mono float32 in [-1, 1] as a 16-bit PCM WAV file."""
    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wav_bytes(audio, sample_rate))
    return path
