"""What a benchmark asks: ``random`` prompts of a given length, or a ``custom`` JSONL file."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from omni_engine.jsonl import jsonl_rows

# Plain words, so that a prompt of N words is about N tokens for any tokenizer and a speech
# stage reads it aloud as text.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government "
         "number night point home water room mother area money story fact month lot right study book eye "
         "job word business issue side kind head house service friend father power hour game line end "
         "member law car city community name president team minute idea kid body information back parent "
         "face others level office door health person art war history party result change morning reason "
         "research girl guy moment air teacher force education").split()


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file and line."""


@dataclass(slots=True)
class BenchRequest:
    prompt: str
    prompt_words: int
    max_tokens: int
    # Speech in (transcription, realtime): a WAV file's bytes; None: the prompt, spoken by the server's
    # own voice before the run (``backends.prepare_audio``).
    audio: bytes | None = None


def random_requests(num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``num`` prompts of ``input_len`` random words, each asking for ``output_len`` tokens."""
    rng = random.Random(seed)
    return [BenchRequest(" ".join(rng.choice(WORDS) for _ in range(input_len)), input_len, output_len)
            for _ in range(num)]


def custom_requests(path: Path, num: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``num`` requests from a JSONL file of ``{"prompt": ..., "max_tokens": ...}`` lines (``max_tokens``
    optional; speech in: ``{"audio": "a.wav"}``, relative to the file, instead of or beside ``prompt``),
    cycled if it has fewer lines, shuffled with ``seed``."""
    rows = []
    try:
        numbered = list(jsonl_rows(path, DatasetError))
    except OSError as exc:
        raise DatasetError(f"--dataset-path {path}: {exc.strerror or exc}") from None
    for number, row in numbered:
        prompt = row.get("prompt") if isinstance(row, dict) else None
        audio_path = row.get("audio") if isinstance(row, dict) else None
        if audio_path is None and (not isinstance(prompt, str) or not prompt):
            raise DatasetError(f"{path}:{number}: expected an object with a non-empty string 'prompt' (or 'audio')")
        max_tokens = row.get("max_tokens", output_len)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise DatasetError(f"{path}:{number}: max_tokens must be a positive integer, got {max_tokens!r}")
        audio = None
        if audio_path is not None:
            try:
                audio = (path.parent / str(audio_path)).read_bytes()
            except OSError as exc:
                raise DatasetError(f"{path}:{number}: audio {audio_path!r}: {exc.strerror or exc}") from None
        prompt = prompt if isinstance(prompt, str) else ""
        rows.append(BenchRequest(prompt, len(prompt.split()), max_tokens, audio))
    if not rows:
        raise DatasetError(f"{path}: no requests in it")
    random.Random(seed).shuffle(rows)
    return [rows[i % len(rows)] for i in range(num)]
