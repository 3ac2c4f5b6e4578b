"""Server VAD for Realtime sessions: the Silero VAD model (v6, ONNX) run by onnxruntime.

The model file ships in the ``silero-vad`` package; it is located without importing that
package (which imports torch). One ``InferenceSession`` serves every stream of the process;
each stream keeps its own recurrent state, so streams never disturb each other. Scoring
reproduces silero's own ``OnnxWrapper`` (512 new samples after the previous input's last 64),
and the speech/silence decision follows its ``get_speech_timestamps`` hysteresis.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from enum import Enum
from typing import Any

import msgspec
import numpy as np

_INSTALL = "server VAD needs the realtime extra: pip install silero-vad==6.2.3 onnxruntime"


def _model_path() -> str:
    """The ONNX file inside the installed silero-vad; ImportError (so callers can fall back) if absent."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"silero-vad is not installed; {_INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "silero_vad.onnx")
    if not os.path.isfile(path):
        raise ImportError(f"silero-vad is installed but has no {path}; {_INSTALL}")
    return path


# Checked at import so that ``from omni_engine.realtime.vad import ...`` fails where VAD cannot run.
MODEL_PATH = _model_path()
if importlib.util.find_spec("onnxruntime") is None:
    raise ImportError(f"onnxruntime is not installed; {_INSTALL}")

_SESSION: Any = None
_SESSION_LOCK = threading.Lock()


def _session() -> Any:
    """The process-wide session, made on first use (loading it costs ~50 ms; imports stay cheap)."""
    global _SESSION
    if _SESSION is None:
        with _SESSION_LOCK:
            if _SESSION is None:
                import onnxruntime

                opts = onnxruntime.SessionOptions()
                # One thread per call: many sessions score concurrently on few cores, and one
                # 576-sample frame is far too small to gain from more.
                opts.intra_op_num_threads = 1
                opts.inter_op_num_threads = 1
                _SESSION = onnxruntime.InferenceSession(MODEL_PATH, sess_options=opts,
                                                        providers=["CPUExecutionProvider"])
    return _SESSION


class VadConfig(msgspec.Struct, frozen=True):
    threshold: float = 0.5            # speech when probability >= threshold
    prefix_padding_ms: int = 300      # audio kept before detected speech onset
    silence_duration_ms: int = 500    # this much silence ends speech

    def validate(self) -> None:
        """ValueError naming the field; a Struct built directly is not type-checked."""
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"turn_detection.threshold must be in [0, 1], got {t!r}")
        for name in ("prefix_padding_ms", "silence_duration_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"turn_detection.{name} must be an integer >= 0, got {v!r}")


class SpeechEventKind(str, Enum):
    STARTED = "started"
    STOPPED = "stopped"


class SpeechEvent(msgspec.Struct, frozen=True):
    kind: SpeechEventKind
    # Offset into the 16 kHz stream fed since construction / reset. started: onset minus the
    # prefix padding (never before 0 or the previous stop); stopped: where the silence reached
    # silence_duration_ms, so the turn's audio includes that silence (OpenAI's audio_end_ms).
    sample: int


class VoiceActivityDetector:
    """One audio stream's speech turns; not thread-safe (one session feeds it)."""

    SAMPLE_RATE = 16000
    FRAME = 512
    CONTEXT = 64  # samples of the previous input the model sees again (as silero's OnnxWrapper)

    def __init__(self, config: VadConfig) -> None:
        config.validate()
        self.config = config
        self._neg_threshold = max(config.threshold - 0.15, 0.01)
        self._prefix = config.prefix_padding_ms * self.SAMPLE_RATE // 1000
        self._silence = config.silence_duration_ms * self.SAMPLE_RATE // 1000
        self._sr = np.array(self.SAMPLE_RATE, dtype=np.int64)
        self._run = _session().run
        self.reset()

    def reset(self) -> None:
        """A new stream: model state, context, remainder and counters start over."""
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._window = np.zeros((1, self.CONTEXT + self.FRAME), dtype=np.float32)  # context + frame
        self._pending = np.zeros(0, dtype=np.float32)
        self._scored = 0          # samples scored (whole frames)
        self._speaking = False
        self._silence_from = -1   # start of the first silent frame of the current pause, or -1
        self._last_stop = 0

    @property
    def speaking(self) -> bool:
        return self._speaking

    @property
    def pause_start(self) -> int | None:
        """While speaking: where the current run of silent frames began (None while speech goes on).
        A turn whose pause has lasted a while can be transcribed before the VAD confirms its end."""
        return self._silence_from if self._speaking and self._silence_from >= 0 else None

    @property
    def samples_seen(self) -> int:
        return self._scored + len(self._pending)

    def speech_probability(self, frame: np.ndarray) -> float:
        """Score the next 512 samples of the stream (advances the model state; ``feed`` uses it)."""
        w = self._window
        w[0, :self.CONTEXT] = w[0, -self.CONTEXT:]
        w[0, self.CONTEXT:] = frame
        out, self._state = self._run(None, {"input": w, "state": self._state, "sr": self._sr})
        return float(out[0, 0])

    def feed(self, samples: np.ndarray) -> list[SpeechEvent]:
        """Mono float32 16 kHz audio, any length; frames fall on fixed offsets, so chunking never matters."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if len(self._pending):
            x = np.concatenate((self._pending, x))
        n = len(x) // self.FRAME * self.FRAME
        events: list[SpeechEvent] = []
        for i in range(0, n, self.FRAME):
            event = self._decide(self.speech_probability(x[i:i + self.FRAME]), self._scored)
            self._scored += self.FRAME
            if event is not None:
                events.append(event)
        self._pending = x[n:].copy()
        return events

    def _decide(self, prob: float, start: int) -> SpeechEvent | None:
        """Silero's hysteresis for the frame at ``start``: speech at >= threshold, silence below
        threshold - 0.15; frames in between (and NaN) neither start nor break a pause."""
        if prob >= self.config.threshold:
            self._silence_from = -1
            if not self._speaking:
                self._speaking = True
                # Started at once (barge-in must be fast); the padding never reaches into the last turn.
                return SpeechEvent(SpeechEventKind.STARTED, max(start - self._prefix, self._last_stop))
        elif self._speaking and prob < self._neg_threshold:
            if self._silence_from < 0:
                self._silence_from = start
            if start + self.FRAME - self._silence_from >= self._silence:
                self._speaking = False
                self._last_stop = self._silence_from + self._silence
                self._silence_from = -1
                return SpeechEvent(SpeechEventKind.STOPPED, self._last_stop)
        return None
