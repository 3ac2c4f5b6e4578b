"""Speech synthesis with eSpeak NG, loaded through ctypes from ``espeakng-loader``.

eSpeak NG is a formant synthesizer: no weights, no GPU, ~800x faster than real
time on one CPU core, so it is a real speech stage that runs anywhere. The
``espeakng-loader`` wheel ships the library and its data: no system package.

eSpeak NG keeps *one* engine per process in global C state (voice, rate, pitch,
synth callback) and is not thread-safe. Hence every call into it is made under
one module-wide lock, the engine is initialised once and terminated when the
last ``EspeakSynthesizer`` closes (calling it after ``espeak_Terminate``
segfaults), and ``EspeakTTSModel`` funnels all synthesis through one worker
thread so the asyncio loop never blocks.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from omni_engine.engines.generation_model import GenerationRequest
from omni_engine.inputs import prompt_text
from omni_engine.stage_output import SPOKEN_TEXT
from omni_engine.params import SpeechParams, speech_params

# Constants from espeak-ng/speak_lib.h.
_AUDIO_OUTPUT_SYNCHRONOUS, _POS_CHARACTER, _CHARS_UTF8 = 2, 1, 1
_INITIALIZE_DONT_EXIT = 0x8000  # without it a failed init calls exit(1) in C
# espeakENDPAUSE: the pause eSpeak makes after a clause inside a text, also after its last one.
_END_PAUSE = 0x1000
# Text that ends a clause or sentence (closing quotes or brackets may follow the mark).
_ENDS_A_CLAUSE = re.compile(r"""[.!?,;:\u2026]['"\u2019\u201d)\]]*\s*$""")
_RATE, _PITCH, _DEFAULT_WPM, _DEFAULT_PITCH = 1, 3, 175, 50
_EE_OK, _EE_NOT_FOUND = 0, 2
_EE_NAMES = {-1: "EE_INTERNAL_ERROR", 1: "EE_BUFFER_FULL", 2: "EE_NOT_FOUND"}

_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def _synth_flags(text: str) -> int:
    """UTF-8, and the pause of a text's last clause when it ends one: speech made sentence by sentence
    (streamed speech, an LLM's answer) keeps the pauses the whole text would have (measured: 0.31 s
    after a sentence, 0.15 s after a comma at 1x; eSpeak drops them at the end of a text). A piece
    cut inside a clause (no mark) gets none, or it would pause mid-sentence."""
    return _CHARS_UTF8 | (_END_PAUSE if _ENDS_A_CLAUSE.search(text) else 0)


class _EspeakVoice(ctypes.Structure):
    """``espeak_VOICE``; ``languages`` is (priority byte, C string) pairs ending in a 0 byte."""

    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_void_p), ("identifier", ctypes.c_char_p)]
    _fields_ += [(f, ctypes.c_ubyte) for f in ("gender", "age", "variant", "xx1")]
    _fields_ += [("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


class EspeakError(RuntimeError):
    """eSpeak NG reported a failure that is not the caller's fault."""


_LOCK = threading.Lock()  # guards the process-global eSpeak state and the fields below
_lib: ctypes.CDLL | None = None
_users = 0
_sample_rate = 0


def _open_library(buflength_ms: int) -> tuple[ctypes.CDLL, int]:
    """Load and initialise eSpeak NG for one more user; call with ``_LOCK`` held."""
    global _lib, _users, _sample_rate
    try:
        import espeakng_loader
    except ImportError as e:
        raise ImportError("eSpeak TTS needs the espeakng-loader package (pip install 'omni_engine[tts]')") from e
    if _lib is None:
        # Not espeakng_loader.load_library(): it prints and returns None on failure.
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByProperties.argtypes = [ctypes.POINTER(_EspeakVoice)]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        # text, size, position, position_type, end_position, flags, unique_identifier, user_data
        u, p = ctypes.c_uint, ctypes.c_void_p
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, u, ctypes.c_int, u, u, p, p]
        lib.espeak_ListVoices.argtypes = [ctypes.c_void_p]
        lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_EspeakVoice))
        _lib = lib
    if _users == 0:
        # The library's compiled-in data path points at the wheel's CI build
        # directory, so the packaged data path must always be passed.
        data_path = os.fsencode(espeakng_loader.get_data_path())
        rate = _lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, buflength_ms, data_path, _INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise EspeakError(f"espeak_Initialize failed (returned {rate}) with data path {data_path!r}")
        _sample_rate = rate
    _users += 1
    return _lib, _sample_rate


def _check(rc: int, call: str) -> None:
    if rc != _EE_OK:
        raise EspeakError(f"eSpeak NG failed {call}: error {rc} ({_EE_NAMES.get(rc, 'unknown')})")


class EspeakSynthesizer:
    """Blocking text-to-PCM synthesis; safe to call from any thread, one call at a time."""

    def __init__(self, *, buflength_ms: int = 200) -> None:
        with _LOCK:
            self._lib, self._sample_rate = _open_library(buflength_ms)
        self._closed = False
        self._chunks: list[bytes] = []
        self._should_abort: Callable[[], bool] | None = None
        self._voices: list[str] | None = None
        # eSpeak stores only the C function pointer; this reference keeps the
        # thunk alive, or the next callback jumps into freed memory.
        self._callback = _SYNTH_CALLBACK(self._on_samples)

    @property
    def sample_rate(self) -> int:
        return self._sample_rate

    def _on_samples(self, wav: Any, numsamples: int, _events: Any) -> int:
        """Collect one buffer of int16 samples; returning 1 tells eSpeak to stop."""
        if numsamples > 0 and wav:
            self._chunks.append(ctypes.string_at(wav, numsamples * 2))
        return 1 if self._should_abort is not None and self._should_abort() else 0

    def _require_open(self) -> None:
        if self._closed:
            raise EspeakError("synthesizer is closed")

    def _select_voice(self, voice: str) -> None:
        """Select a voice that ``list_voices`` offers, optionally with a variant
        (``en-us+f3``: one of ``list_variants``); anything else is a ValueError.

        eSpeak's own matching is by prefix ("no-such-voice" would select
        Norwegian) and ignores unknown variants, so both are checked first.
        """
        base, _, variant = voice.partition("+")
        if base.lower() not in self._known_voices_locked():
            raise ValueError(f"unknown voice {voice!r}; list_voices() gives the accepted codes (e.g. 'en', 'en-us')")
        if variant and variant.lower() not in _variants():
            raise ValueError(f"unknown voice variant {variant!r} in {voice!r}; list_variants() gives them "
                             "(e.g. 'f3', 'm3')")
        self._try_voice(voice)

    def _try_voice(self, voice: str) -> None:
        encoded = voice.encode("utf-8")
        rc = self._lib.espeak_SetVoiceByName(encoded)
        if rc == _EE_NOT_FOUND:
            # SetVoiceByName matches voice names and voice-file names only
            # ("en", "en-us"), not language codes such as "en-gb" or "zh";
            # language matching is what SetVoiceByProperties does.
            language = ctypes.create_string_buffer(encoded)
            spec = _EspeakVoice(languages=ctypes.addressof(language))
            rc = self._lib.espeak_SetVoiceByProperties(ctypes.byref(spec))
        if rc == _EE_NOT_FOUND:
            raise ValueError(f"unknown voice {voice!r}; list_voices() gives the accepted codes (e.g. 'en', 'en-us')")
        _check(rc, f"selecting voice {voice!r}")

    def check_voice(self, voice: str) -> None:
        """Raise ``ValueError`` if ``voice`` cannot be selected, so configs fail at startup."""
        SpeechParams(voice=voice).validate()
        with _LOCK:
            self._require_open()
            self._select_voice(voice)

    def list_variants(self) -> list[str]:
        """Voice variants (``m1``..``m8``, ``f1``..``f5``, ``klatt``, ...), as ``voice+variant``."""
        return list(_variants())

    def list_voices(self) -> list[str]:
        """Lower-case ``voice`` values: language codes (``en-gb``, ``zh``) and voice files (``en-us``).

        Each candidate is tried once and cached (~30 ms): eSpeak lists some
        codes its own matching cannot find (Cherokee's ``chr-us-qaaa-x-west``;
        its voice file ``chr`` works). Names like ``"English (America)"`` also work.
        """
        with _LOCK:
            self._require_open()
            return list(self._known_voices_locked())

    def _known_voices_locked(self) -> list[str]:
        if self._voices is None:
            candidates: set[str] = set()
            voices = self._lib.espeak_ListVoices(None)
            for i in itertools.count():
                if not voices[i]:
                    break
                candidates.add(voices[i].contents.identifier.decode().rsplit("/", 1)[-1].lower())
                candidates.add(voices[i].contents.name.decode().lower())
                ptr = voices[i].contents.languages
                while ctypes.string_at(ptr, 1) != b"\x00":  # priority byte; 0 ends the list
                    code = ctypes.string_at(ptr + 1)
                    candidates.add(code.decode().lower())
                    ptr += len(code) + 2
            voices_ok = []
            for code in sorted(candidates):
                try:
                    self._try_voice(code)
                except ValueError:
                    continue
                voices_ok.append(code)
            self._voices = voices_ok
        return self._voices

    def synthesize(self, text: str, params: SpeechParams, should_abort: Callable[[], bool] | None = None) -> np.ndarray:
        """Render ``text`` to mono float32 PCM in [-1, 1] at ``sample_rate``.

        ``should_abort`` is polled after every audio buffer so an aborted
        request stops early; the audio produced so far is returned.
        """
        params.validate()
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            return np.zeros(0, dtype=np.float32)
        data = text.replace("\x00", " ").encode("utf-8")  # C string: NUL would truncate
        with _LOCK:
            self._require_open()
            lib = self._lib
            lib.espeak_SetSynthCallback(self._callback)  # another instance may have replaced it
            # Rate and pitch are global and persist: set both on every call so
            # one request's settings never leak into the next.
            self._select_voice(params.voice)
            _check(lib.espeak_SetParameter(_RATE, round(_DEFAULT_WPM * params.speed), 0), "setting the rate")
            pitch = _DEFAULT_PITCH if params.pitch is None else params.pitch
            _check(lib.espeak_SetParameter(_PITCH, pitch, 0), "setting the pitch")
            self._chunks, self._should_abort = [], should_abort
            try:
                rc = lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _synth_flags(text), None, None)
                pcm = b"".join(self._chunks)
            finally:
                self._chunks, self._should_abort = [], None
        _check(rc, "synthesizing")
        return np.frombuffer(pcm, dtype=np.int16).astype(np.float32) / np.float32(32768.0)

    def close(self) -> None:
        """Release this user; the last one terminates eSpeak. Idempotent."""
        global _users
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            _users -= 1
            if _users == 0:
                _check(self._lib.espeak_Terminate(), "terminating")


# OpenAI's voice names, each a distinct eSpeak NG voice + variant. A stage
# overrides or extends this with engine_args.voice_map; eSpeak's own codes
# ("en", "en-gb", "en-us+f2", ...) are accepted as they are.
OPENAI_VOICES: dict[str, str] = {
    "alloy": "en-us+f3", "ash": "en-us+m3", "ballad": "en-gb+m5", "coral": "en-us+f2",
    "echo": "en-us+m1", "fable": "en-gb+m2", "onyx": "en-us+m7", "nova": "en-us+f4",
    "sage": "en-gb+f3", "shimmer": "en-us+f5", "verse": "en-us+m4",
}


@functools.cache
def _variants() -> tuple[str, ...]:
    """The variant names in eSpeak NG's data (``voices/!v``), lower-case."""
    import espeakng_loader

    variant_dir = os.path.join(espeakng_loader.get_data_path(), "voices", "!v")
    return tuple(sorted(name.lower() for name in os.listdir(variant_dir) if " " not in name))


class EspeakTTSModel:
    """``GenerationModel`` that renders text requests to speech with eSpeak NG."""

    output_type = "audio"
    renders_alone = True  # eSpeak speaks one text at a time: the engine picks the next by deadline

    def __init__(self, *, default_voice: str = "en", max_workers: int = 1,
                 voice_map: Mapping[str, str] | None = None) -> None:
        if max_workers != 1:
            # eSpeak's state is process-global: extra threads would only queue on the lock.
            raise ValueError(f"max_workers must be 1 (eSpeak NG has one global engine), got {max_workers!r}")
        if voice_map is not None and not isinstance(voice_map, Mapping):
            raise TypeError(f"voice_map must be a mapping of names to eSpeak voices, got {type(voice_map).__name__}")
        # Names are matched case-insensitively, as eSpeak's codes are.
        self.voice_map = {**OPENAI_VOICES, **{str(k).lower(): v for k, v in (voice_map or {}).items()}}
        self._synth = EspeakSynthesizer()
        try:
            self._synth.check_voice(self.resolve_voice(default_voice))
            for name, voice in self.voice_map.items():  # a bad table fails the stage's start, naming the entry
                try:
                    self._synth.check_voice(voice)
                except ValueError as exc:
                    raise ValueError(f"voice_map[{name!r}]: {exc}") from None
            self._voices = self._synth.list_voices()
        except BaseException:
            self._synth.close()
            raise
        self._default_voice = default_voice
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="espeak")
        self._closed = False

    def resolve_voice(self, voice: str) -> str:
        """The eSpeak voice for a request's ``voice``: a mapped name (``alloy``) or an eSpeak code."""
        return self.voice_map.get(voice.lower(), voice) if isinstance(voice, str) else voice

    def _params(self, raw: Any) -> SpeechParams:
        return speech_params(raw, self._default_voice)

    def _render(self, request: GenerationRequest) -> dict[str, Any] | Exception:
        if request.aborted:
            return RuntimeError("aborted")
        try:
            text, params = prompt_text(request.prompt), self._params(request.params)
            params.validate()
            params = msgspec.structs.replace(params, voice=self.resolve_voice(params.voice))
            audio = self._synth.synthesize(text, params, lambda: request.aborted)
        except Exception as e:  # the protocol fails this request alone
            return e
        if request.aborted:
            return RuntimeError("aborted")
        return {"audio": audio, "sample_rate": self._synth.sample_rate, SPOKEN_TEXT: text}

    def _render_batch(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        return [self._render(r) for r in requests]

    async def generate(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        """Render a batch in one hop to the worker thread, one result per request, in order."""
        if self._closed:
            raise RuntimeError("EspeakTTSModel is shut down")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._render_batch, list(requests))

    def info(self) -> dict[str, Any]:
        """What the stage's READY tells the client; ``voice_map`` and ``voices`` back ``GET /v1/audio/voices``."""
        return {"sample_rate": self._synth.sample_rate, "engine": "espeak-ng", "voice_map": dict(self.voice_map),
                "voices": list(self._voices), "variants": list(_variants())}

    async def shutdown(self) -> None:
        """Drop queued batches, wait for the running one off-loop, then close eSpeak. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._synth.close()


def make_espeak_tts(**engine_args: Any) -> EspeakTTSModel:
    """Stage-config factory (``omni_engine.engines.tts:make_espeak_tts``); rejects unknown args by name."""
    allowed = {"default_voice", "max_workers", "voice_map"}
    unknown = sorted(set(engine_args) - allowed)
    if unknown:
        raise TypeError(f"make_espeak_tts got unknown engine_args {unknown}; allowed: {sorted(allowed)}")
    return EspeakTTSModel(**engine_args)
