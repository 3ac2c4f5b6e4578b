"""Speech in: what an ``llm`` stage running Whisper does with an audio prompt.

vLLM runs Whisper as an encoder-decoder model: the audio (at most one window: 30 s, or what the
checkpoint's ``max_source_positions`` holds, 20 ms each) goes to the
encoder as multimodal data, and the decoder starts from Whisper's task tokens
(``<|startoftranscript|><|fr|><|transcribe|><|notimestamps|>``; an English-only ``.en`` model
knows no language or task tokens). A stage's callers should not have to know that, so an audio
prompt is just ``{"prompt": <optional text hint>, "multi_modal_data": {"audio": samples or
(samples, rate)}, "mm_processor_kwargs": {"language": ..., "task": ...}}`` (a dict or an
``OmniTextPrompt``), and :class:`SpeechToText` turns it into vLLM requests:

* audio longer than the window is cut at the quietest moment before each window's end and the
  segments are transcribed in order, streamed as one request (vLLM's own transcription server
  does the same);
* without a language, a multilingual model first names the language itself (one decoding step
  restricted to the language tokens, as Whisper does);
* the final output carries ``language``, ``duration`` and the ``segments`` (start, end, text).
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_engine.audio import WHISPER_SAMPLE_RATE
from omni_engine.inputs import OmniTextPrompt
from omni_engine.models.whisper_ct2 import POSITIONS_PER_S

__all__ = ["SAMPLE_RATE", "AudioPrompt", "SpeechToText", "audio_prompt_of", "split_on_silence", "word_error_rate"]

SAMPLE_RATE = WHISPER_SAMPLE_RATE
WINDOW_S = 30.0
# A cut is made at the quietest 100 ms in the last CUT_SEARCH_S seconds before each window's end
# (at most a third of a shorter window, so no segment is left very short).
CUT_SEARCH_S = 8.0
_FRAME_S = 0.1
MAX_AUDIO_S = 3600.0  # one request's audio; longer uploads are refused, naming the limit
TASKS = ("transcribe", "translate")


@dataclass(frozen=True, slots=True)
class AudioPrompt:
    """A checked audio prompt: mono float32 at 16 kHz, with what to do with it."""

    audio: np.ndarray
    language: str | None
    task: str
    text: str


def audio_prompt_of(prompt: Any) -> AudioPrompt | None:
    """The audio prompt in ``prompt``; None when it carries no audio (a text prompt).

    ``ValueError`` names what is wrong with a prompt that does carry audio.
    """
    if isinstance(prompt, OmniTextPrompt):
        mm, kwargs, text = prompt.multi_modal_data, prompt.mm_processor_kwargs, prompt.prompt
    elif isinstance(prompt, dict) and "encoder_prompt" not in prompt:
        mm, kwargs, text = prompt.get("multi_modal_data"), prompt.get("mm_processor_kwargs"), prompt.get("prompt")
    else:
        return None
    if not mm or mm.get("audio") is None:
        return None
    kwargs = dict(kwargs or {})
    task = kwargs.pop("task", None) or "transcribe"
    language = kwargs.pop("language", None) or None
    if kwargs:
        raise ValueError(f"mm_processor_kwargs {sorted(kwargs)} are not understood by a speech-to-text stage "
                         f"(it takes 'language' and 'task')")
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not supported; use one of {list(TASKS)}")
    if language is not None and (not isinstance(language, str) or not language.isalpha()):
        raise ValueError(f"language {language!r} is not an ISO 639-1 code such as 'en'")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt must be text (a hint for the transcription), got {type(text).__name__}")
    return AudioPrompt(_samples(mm["audio"]), language.lower() if language else None, task, text or "")


def _samples(audio: Any) -> np.ndarray:
    """Mono float32 samples at 16 kHz from ``samples`` or ``(samples, rate)``."""
    rate = SAMPLE_RATE
    if isinstance(audio, (tuple, list)) and len(audio) == 2 and np.isscalar(audio[1]):
        audio, rate = audio
    try:
        samples = np.asarray(audio, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"multi_modal_data.audio must be an array of samples: {exc}") from None
    if samples.ndim == 2:  # (channels, samples) or (samples, channels): mix down
        samples = samples.mean(axis=0 if samples.shape[0] < samples.shape[1] else 1)
    if samples.ndim != 1:
        raise ValueError(f"multi_modal_data.audio must be mono samples (1-D), got shape {samples.shape}")
    if not samples.size:
        raise ValueError("multi_modal_data.audio is empty")
    if not np.isfinite(samples).all():
        raise ValueError("multi_modal_data.audio contains NaN or infinite samples")
    rate = int(rate)
    if rate <= 0:
        raise ValueError(f"audio sample rate must be positive, got {rate}")
    if samples.size / rate > MAX_AUDIO_S:
        raise ValueError(f"audio is {samples.size / rate:.0f} s long; at most {MAX_AUDIO_S:.0f} s per request")
    if rate != SAMPLE_RATE:
        from scipy.signal import resample_poly

        g = math.gcd(rate, SAMPLE_RATE)
        samples = resample_poly(samples, SAMPLE_RATE // g, rate // g).astype(np.float32)
    return samples


def split_on_silence(audio: np.ndarray, rate: int = SAMPLE_RATE, window_s: float = WINDOW_S,
                     search_s: float = CUT_SEARCH_S) -> list[tuple[int, int]]:
    """``(start, end)`` sample ranges of at most ``window_s`` each, cut at the quietest
    ``_FRAME_S`` in the last ``search_s`` before each window's end (not inside a word)."""
    window, frame = int(window_s * rate), max(1, int(_FRAME_S * rate))
    spans, start = [], 0
    while audio.size - start > window:
        lo = start + window - int(search_s * rate)
        region = audio[lo:start + window]
        frames = region[: region.size // frame * frame].reshape(-1, frame)
        quietest = int(np.argmin((frames.astype(np.float64) ** 2).mean(axis=1)))
        cut = lo + quietest * frame + frame // 2
        spans.append((start, cut))
        start = cut
    spans.append((start, audio.size))
    return spans


class SpeechToText:
    """Whisper requests for audio prompts on one vLLM ``AsyncLLM`` (an ``llm`` stage's engine)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = Path(model_name).name  # the prepared directory's name, e.g. whisper-tiny.en
        tokenizer = engine.get_tokenizer()
        vocab = tokenizer.get_vocab()
        self._token = {t: vocab[t] for t in ("<|startoftranscript|>", "<|notimestamps|>", "<|startofprev|>",
                                             "<|transcribe|>", "<|translate|>") if t in vocab}
        self._tokenizer = tokenizer
        # Whisper's special tokens (<|endoftext|> and everything after it) are not text.
        self._first_special = vocab["<|endoftext|>"]
        # A multilingual model has language tokens <|en|>, <|fr|>, ...; an English-only one uses none.
        self.languages = {tok[2:-2]: tid for tok, tid in vocab.items()
                          if tok.startswith("<|") and tok.endswith("|>") and 2 <= len(tok) - 4 <= 3
                          and tok[2:-2].isalpha() and tok[2:-2].islower()}
        # As openai-whisper decides: the English-only models have one token fewer (51864).
        self.multilingual = engine.model_config.hf_config.vocab_size >= 51865
        self.max_prompt_tokens = engine.model_config.hf_config.max_target_positions // 2 - 1
        # The encoder's window (prepare-model's whisper-tiny-en-15s recipe shortens it for voice turns).
        self.window_s = engine.model_config.hf_config.max_source_positions / POSITIONS_PER_S
        # Pipeline request id -> the vLLM request now running for it (a segment or the detection).
        self.running: dict[str, str] = {}
        self.aborted: set[str] = set()  # requests aborted while running: no further segment starts

    def info(self) -> dict[str, Any]:
        return {"input_modalities": ["audio"], "multilingual": self.multilingual,
                "languages": sorted(self.languages) if self.multilingual else ["en"],
                "sample_rate": SAMPLE_RATE}

    def decoder_prefix(self, language: str, task: str, hint: str) -> list[int]:
        """Whisper's decoder start: ``[<|startofprev|> hint] <|startoftranscript|> [<|lang|> <|task|>] <|notimestamps|>``."""
        ids: list[int] = []
        if hint:
            hint_ids = self._tokenizer.encode(" " + hint.strip(), add_special_tokens=False)
            ids = [self._token["<|startofprev|>"], *hint_ids[-self.max_prompt_tokens:]]
        ids.append(self._token["<|startoftranscript|>"])
        if self.multilingual:
            ids += [self.languages[language], self._token[f"<|{task}|>"]]
        ids.append(self._token["<|notimestamps|>"])
        return ids

    def check(self, prompt: AudioPrompt) -> None:
        """``ValueError`` for what this model cannot do (a language it lacks, translating with a .en model)."""
        if not self.multilingual:
            if prompt.language not in (None, "en"):
                raise ValueError(f"{self.model_name} is an English-only Whisper model; language "
                                 f"{prompt.language!r} is not supported (use 'en' or a multilingual model)")
            if prompt.task != "transcribe":
                raise ValueError(f"{self.model_name} is an English-only Whisper model: it cannot translate")
        elif prompt.language is not None and prompt.language not in self.languages:
            raise ValueError(f"language {prompt.language!r} is not one of {self.model_name}'s languages "
                             f"({', '.join(sorted(self.languages))})")

    async def generate(self, request_id: str, prompt: AudioPrompt, params: Any,
                       priority: int = 0) -> AsyncIterator[Any]:
        """vLLM ``RequestOutput``s of the whole audio as one request ``request_id``.

        Segments run one after another; their outputs are re-labelled so that the caller sees
        one stream (cumulative text keeps the earlier segments' text in front). The last output
        carries ``language``, ``duration`` and ``segments`` in ``multimodal_output``. ``priority``:
        vLLM's, for an engine that schedules by priority (a live turn before a batch file).
        """
        from vllm.sampling_params import RequestOutputKind

        self.check(prompt)
        spans = split_on_silence(prompt.audio, window_s=self.window_s,
                                 search_s=min(CUT_SEARCH_S, self.window_s / 3))
        # CUMULATIVE and FINAL_ONLY outputs carry a segment's whole text so far (the earlier segments'
        # text goes in front); DELTA outputs only the new piece. FINAL_ONLY yields the last output alone.
        cumulative = params.output_kind != RequestOutputKind.DELTA
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        done_text, done_ids, segments = "", [], []
        try:
            language = prompt.language or ("en" if not self.multilingual else
                                           await self._detect_language(request_id, prompt.audio, priority))
            prefix = self.decoder_prefix(language, prompt.task, prompt.text)  # the same for every window
            for k, (start, end) in enumerate(spans):
                if request_id in self.aborted:
                    return
                last = k == len(spans) - 1
                vllm_prompt = _whisper_prompt(prompt.audio[start:end], prefix)
                sub_id = self.running[request_id] = f"{request_id}#s{k}"
                text, ids, output = "", [], None
                async for output in self.engine.generate(vllm_prompt, params, sub_id, priority=priority):
                    completion = output.outputs[0]
                    text = completion.text if cumulative else text + completion.text
                    ids = list(completion.token_ids) if cumulative else ids + list(completion.token_ids)
                    output.request_id = request_id
                    if cumulative:
                        completion.text = done_text + completion.text
                        completion.token_ids = done_ids + list(completion.token_ids)
                    if output.finished and not last:
                        output.finished = False
                        completion.finish_reason = None
                    if not final_only and (not last or not output.finished):
                        yield output
                segments.append({"id": k, "start": round(start / SAMPLE_RATE, 3),
                                 "end": round(end / SAMPLE_RATE, 3), "text": text.strip(),
                                 "tokens": [t for t in ids if t < self._first_special]})
                done_text, done_ids = done_text + text, done_ids + ids
            output.multimodal_output = {"language": language, "duration": round(prompt.audio.size / SAMPLE_RATE, 3),
                                        "segments": segments}
            yield output
        finally:
            self.running.pop(request_id, None)
            self.aborted.discard(request_id)

    async def _detect_language(self, request_id: str, audio: np.ndarray, priority: int = 0) -> str:
        """The language Whisper hears in the first window: one step over the language tokens."""
        from vllm import SamplingParams

        first = audio[: int(self.window_s * SAMPLE_RATE)]
        detect = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=list(self.languages.values()))
        prompt = _whisper_prompt(first, [self._token["<|startoftranscript|>"]])
        by_id = {tid: code for code, tid in self.languages.items()}
        sub_id = self.running[request_id] = f"{request_id}#lang"
        token = None
        async for output in self.engine.generate(prompt, detect, sub_id, priority=priority):
            if output.outputs[0].token_ids:
                token = output.outputs[0].token_ids[0]
        return by_id.get(token, "en")

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Stop ``request_ids`` after their current segment; the vLLM requests to abort now."""
        running = [rid for rid in request_ids if rid in self.running]
        self.aborted.update(running)
        return [self.running[rid] for rid in running]


def _whisper_prompt(audio: np.ndarray, decoder_ids: list[int]) -> dict[str, Any]:
    """vLLM's encoder-decoder prompt: the audio to the encoder, ``decoder_ids`` to start the decoder."""
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (audio, SAMPLE_RATE)}},
            "decoder_prompt": {"prompt_token_ids": decoder_ids}}


def normalize_words(text: str) -> list[str]:
    """Lower-case words without punctuation (how a transcript is compared with its reference)."""
    return re.sub(r"[^\w' ]+", " ", text.lower().replace("-", " ").replace("_", " ")).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word error rate: (substitutions + deletions + insertions) / reference words, after
    ``normalize_words`` (Levenshtein distance over words)."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    if not ref:
        raise ValueError("the reference has no words")
    row = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, other in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (word != other))
    return row[-1] / len(ref)
