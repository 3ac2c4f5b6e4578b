"""Edge input processors: how one stage's outputs become the next stage's inputs.

A stage config names a processor factory by dotted path
(``custom_process_input_func``), called as ``factory(sources, dst, prompt)``;
the orchestrator makes one processor per request and destination stage, so a
processor may keep state (e.g. half a sentence) and sees every source of a
fan-in.

* ``on_output`` is called for every upstream output in ``async_chunk`` mode;
  whatever it returns is forwarded at once, so the downstream stage works
  while the upstream one is still generating.
* ``on_finish`` is called once when every source stage is done with the
  request (in both modes), with each source's outputs and text; in
  ``sequential`` mode it is the only call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    # Annotations only: a config that names these processors is checked (and serve starts its
    # stages) before anything imports vLLM, which omni_engine.outputs does.
    from omni_engine.outputs import OmniRequestOutput
    from omni_engine.pipeline.playback_clock import PlaybackClock


@dataclass(slots=True)
class StageInput:
    """One request for a downstream stage. ``sampling_params`` None means the
    stage's own parameters for this request.

    An input in parts: ``opens_stream`` starts a request whose input goes on; each later input with
    ``continues`` is appended to it (``last``: its input ends there), on the replica running it."""

    prompt: Any
    sampling_params: Any = None
    opens_stream: bool = False
    continues: bool = False
    last: bool = False


class InputProcessor(Protocol):
    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]: ...

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]: ...


@runtime_checkable
class FollowsPlayback(Protocol):
    """A processor that paces what it sends by the request's listener (e.g. ``listener_pacing``):
    the orchestrator hands it the request's ``PlaybackClock`` when the request ends in speech."""

    def follow_playback(self, clock: PlaybackClock) -> None: ...


class TextPassthrough:
    """Default: the upstream text goes on as the prompt (whole, or chunk by chunk)."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.sources, self.dst = sources, dst

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        return [StageInput(new_text)] if new_text else []

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        joined = "\n".join(t for t in text.values() if t)
        return [StageInput(joined)] if joined.strip() else []


# A sentence ends at . ! ? (or their CJK forms), optionally followed by closing
# quotes/brackets, then whitespace. Abbreviations may split early; for speech
# that costs a pause, not a word. Streamed text that ends in . ! ? right after a
# lower-case word ends a sentence at once, without waiting one more token for the
# whitespace (the first sentence's audio starts that much sooner); not after a
# digit (3.5), a capital (Mr.) or a dotted abbreviation (e.g.).
_SENTENCE_END = re.compile(r"""[.!?。！？…]+["'”’)\]]*(?=\s)|[。！？]|(?<=[a-z]{2})[.!?]+$""")


# A clause ends at , ; : or a dash, then whitespace (not inside 1,000 or 10:30).
_CLAUSE_END = re.compile(r"""[,;:—–]["'”’)\]]*(?=\s)""")


def _words(n: int) -> re.Pattern[str]:
    """The first ``n`` words of a text, once the whitespace after the last shows it is whole."""
    return re.compile(rf"\s*(?:\S+\s+){{{n - 1}}}\S+(?=\s)")


def split_sentences(text: str, min_chars: int = 2, first_fragment_words: int = 0) -> list[str]:
    """``text`` as its sentences (the last one may lack an ending), as ``SentenceSplitter`` cuts them."""
    splitter = SentenceSplitter([], 0, min_chars=min_chars, first_fragment_words=first_fragment_words)
    inputs = splitter.on_output(None, text) + splitter.on_finish({}, {})  # type: ignore[arg-type]
    return [inp.prompt for inp in inputs]


# A passage spoken at once (``/v1/audio/speech``): its first piece is its first sentence when that
# is this short (~3 s of speech), else that sentence's first clause or first words; the first audio
# waits for the synthesis of that piece alone, and the rest is made while it plays.
FIRST_PIECE_MAX_WORDS = 8
FIRST_PIECE_WORDS = 6


def split_for_speech(text: str) -> list[str]:
    """``text`` as the pieces it is spoken in: sentences, the first one cut when it is long."""
    pieces = split_sentences(text)
    if pieces and len(pieces[0].split()) > FIRST_PIECE_MAX_WORDS:
        pieces[:1] = split_sentences(pieces[0], first_fragment_words=FIRST_PIECE_WORDS)
    return pieces


class SentenceSplitter:
    """Forwards complete sentences as they appear in the streamed text.

    In ``async_chunk`` mode each sentence goes downstream (e.g. to speech
    synthesis) as soon as it is complete; the rest is flushed at the end.
    In ``sequential`` mode the whole text goes as one input.
    """

    def __init__(self, sources: list[int], dst: int, prompt: Any = None, min_chars: int = 2,
                 first_fragment_words: int = 0) -> None:
        self.sources, self.dst = sources, dst
        self.min_chars = min_chars
        self.first_fragment_words = first_fragment_words
        self._pending = ""
        self._streamed = False
        self._sent = False  # a piece of this reply has gone downstream

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        self._streamed = True
        self._pending += new_text
        inputs = []
        while match := self._next_end():
            sentence, self._pending = self._pending[: match.end()], self._pending[match.end():]
            if len(sentence.strip()) >= self.min_chars:
                inputs.append(StageInput(sentence.strip()))
                self._sent = True
            elif inputs:  # a stray "." joins the previous sentence
                inputs[-1].prompt += sentence.strip()
        return inputs

    def _next_end(self) -> re.Match[str] | None:
        """Where the next piece ends: a sentence's end; for a reply's first piece with
        ``first_fragment_words``, also the first clause's end or the end of that many words."""
        end = _SENTENCE_END.search(self._pending)
        if self.first_fragment_words <= 0 or self._sent or not self._pending.strip():
            return end
        cuts = [m for m in (end, _CLAUSE_END.search(self._pending),
                            _words(self.first_fragment_words).match(self._pending)) if m is not None]
        return min(cuts, key=lambda m: m.end(), default=None)

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        if not self._streamed:
            self._pending = "\n".join(t for t in text.values() if t)
        rest, self._pending = self._pending.strip(), ""
        return [StageInput(rest)] if rest else []


# Tool-call markup LLMs write into their text, as (opening, closing); None: the call runs to the
# end. Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS], Llama 3 <|python_tag|>.
TOOL_CALL_MARKUP: tuple[tuple[str, str | None], ...] = (
    ("<tool_call>", "</tool_call>"), ("[TOOL_CALLS]", None), ("<|python_tag|>", None))
# A reply that opens with a JSON object naming a function (maybe in a ```json fence) is a call
# written without markup (what Qwen2.5-Coder-0.5B does; the server's `hermes_json` tool parser
# reads it as one). Text that is still a prefix of that cannot be told from speech yet.
BARE_TOOL_CALL = re.compile(r'\s*(```(json)?\s*)?\{\s*"name"')
_OBJECT_START = r'\{\s*("(n(a(m(e)?)?)?)?)?'
MAYBE_BARE_TOOL_CALL = re.compile(rf'\s*(`{{1,2}}|```(j(s(o(n)?)?)?)?|```(json)?\s*({_OBJECT_START})?|{_OBJECT_START})?')


def opens_with_bare_call(text: str, final: bool = False) -> bool | None:
    """Whether a reply that begins with ``text`` is a bare (or fenced) JSON call; None while its start
    could still become one (unless ``final``: no more text comes). The speech stage and the
    ``hermes_json`` tool parser decide alike."""
    if BARE_TOOL_CALL.match(text):
        return True
    if MAYBE_BARE_TOOL_CALL.fullmatch(text) and not final:
        return None
    return False

class SpokenSentences(SentenceSplitter):
    """``SentenceSplitter`` for a speech stage: the tool calls an LLM writes are not speech.

    Text inside tool-call markup (``TOOL_CALL_MARKUP``), and a reply that opens with a bare JSON
    call, never reach the speech stage; the client gets the calls from the text stage's output
    through the server's tool parser. A marker split over two outputs is held back until it
    can be told from text.
    """

    def __init__(self, sources: list[int], dst: int, prompt: Any = None, min_chars: int = 2,
                 first_fragment_words: int = 0) -> None:
        super().__init__(sources, dst, prompt, min_chars, first_fragment_words)
        self._raw = ""  # text not yet judged speech or markup
        self._closing: str | None = None  # inside a call: its closing marker ("" = to the end)
        self._opened = False  # the reply's start has been judged (bare call or not)

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        return super().on_output(output, self._speakable(new_text))

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        if self._streamed:
            self._pending += self._speakable("", final=True)
        else:
            self._streamed = True
            self._pending = self._speakable("\n".join(t for t in text.values() if t), final=True)
        return super().on_finish(outputs, text)

    def _speakable(self, new_text: str, final: bool = False) -> str:
        """Of the text so far, what is now known to be speech."""
        self._raw += new_text
        if not self._opened:
            bare = opens_with_bare_call(self._raw, final)
            if bare is None:
                return ""
            if bare:
                self._closing, self._raw = "", ""
            self._opened = True
        spoken = []
        while self._raw:
            if self._closing == "":
                self._raw = ""
            elif self._closing is not None:
                end = self._raw.find(self._closing)
                if end < 0:  # keep what may be the start of the closing marker
                    self._raw = "" if final else self._raw[len(self._raw) - len(self._closing) + 1:]
                    break
                self._raw, self._closing = self._raw[end + len(self._closing):], None
            elif found := [(i, opening, closing) for opening, closing in TOOL_CALL_MARKUP
                           if (i := self._raw.find(opening)) >= 0]:
                i, opening, closing = min(found)
                spoken.append(self._raw[:i])
                self._raw, self._closing = self._raw[i + len(opening):], closing or ""
            else:
                hold = 0 if final else _partial_marker(self._raw)
                spoken.append(self._raw[:len(self._raw) - hold])
                self._raw = self._raw[len(self._raw) - hold:]
                break
        return "".join(spoken)


_LONGEST_OPENING = max(len(opening) for opening, _ in TOOL_CALL_MARKUP)


def _partial_marker(text: str) -> int:
    """Length of the longest end of ``text`` that begins an opening marker (0 if none)."""
    for n in range(min(len(text), _LONGEST_OPENING - 1), 0, -1):
        if any(opening.startswith(text[-n:]) for opening, _ in TOOL_CALL_MARKUP):
            return n
    return 0


class MultimodalForward:
    """Each upstream output's ``multimodal_output`` (e.g. ``{"phoneme_ids": tensor}``) is the next
    stage's prompt: output by output in ``async_chunk`` mode, all of them at the end otherwise.
    Tensors stay wire tensors (shared memory above the threshold): nothing is turned into lists."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.sources, self.dst = sources, dst
        self._streamed = False

    def on_output(self, output: OmniRequestOutput, new_text: str) -> list[StageInput]:
        self._streamed = True
        return [StageInput(dict(output.multimodal_output))] if output.multimodal_output else []

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        if self._streamed:
            return []
        return [StageInput(dict(out.multimodal_output)) for src in self.sources for out in outputs.get(src, ())
                if out.multimodal_output]


def multimodal(sources: list[int], dst: int, prompt: Any = None) -> MultimodalForward:
    """Factory for stage configs: ``omni_engine.pipeline.input_processors:multimodal``."""
    return MultimodalForward(sources, dst, prompt)


def sentences(sources: list[int], dst: int, prompt: Any = None) -> SentenceSplitter:
    """Factory for stage configs: ``omni_engine.pipeline.input_processors:sentences``."""
    return SentenceSplitter(sources, dst, prompt)


def spoken_sentences(sources: list[int], dst: int, prompt: Any = None) -> SpokenSentences:
    """Factory for stage configs: ``omni_engine.pipeline.input_processors:spoken_sentences``."""
    return SpokenSentences(sources, dst, prompt)


# A live voice's first piece of a reply: its first clause or sentence, or its first 4 words,
# whichever ends first. The first audio then waits for ~4 tokens and the synthesis of ~1.4 s of
# speech instead of a whole sentence's; later sentences are synthesized while the earlier ones
# play, so they stay whole (a cut costs a little prosody, paid once).
FIRST_FRAGMENT_WORDS = 4


def spoken_fragments(sources: list[int], dst: int, prompt: Any = None) -> SpokenSentences:
    """Factory for stage configs: ``omni_engine.pipeline.input_processors:spoken_fragments``:
    ``spoken_sentences`` whose first piece is cut early (``FIRST_FRAGMENT_WORDS``), for real-time voice."""
    return SpokenSentences(sources, dst, prompt, first_fragment_words=FIRST_FRAGMENT_WORDS)


def text(sources: list[int], dst: int, prompt: Any = None) -> TextPassthrough:
    """Factory for stage configs: ``omni_engine.pipeline.input_processors:text``."""
    return TextPassthrough(sources, dst, prompt)
