"""Per-request parameter types that the client and the stages both use.

Like vLLM's ``sampling_params`` module: the client builds and checks them, the
wire carries them, the stage's engine reads them. Kept out of ``engines/`` so
that the client side (server, orchestrator, wire) never imports engine code.
Imports no vLLM: a stage that runs none reads its params from here too (vLLM's
types are imported inside the functions that build them, which only the client
and llm stages call).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


class NeutralSamplingParams:
    """A vLLM ``SamplingParams`` as a stage without vLLM receives it: its fields, as sent.

    vLLM-Omni's callers pass a ``SamplingParams`` to every stage; a speech or image stage
    reads it as "no params of my own" (``is_llm_sampling_params``), and need not import
    vLLM (seconds, hundreds of MB) to decode it. The wire encodes it back as the same ext.
    """

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def get(self, name: str, default: Any = None) -> Any:
        """A field as sent (vLLM leaves out fields at their defaults)."""
        return self.fields.get(name, default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeutralSamplingParams) and other.fields == self.fields

    def __repr__(self) -> str:
        return f"NeutralSamplingParams({self.fields!r})"


def is_llm_sampling_params(raw: Any) -> bool:
    """Whether ``raw`` is an LLM's sampling params (vLLM's, or their neutral form in a stage
    without vLLM): params that say nothing to a speech or image model. Imports no vLLM."""
    return isinstance(raw, NeutralSamplingParams) or type(raw).__name__ == "SamplingParams"


class SpeechParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request speech settings, shaped like OpenAI's speech API.

    ``speed`` multiplies eSpeak's default 175 words/minute. eSpeak's slowest
    rate is 80 wpm, so speeds below ~0.46 all sound the same. Unknown fields
    are rejected so that a typo (``"sped"``) fails loudly instead of being ignored.
    """

    voice: str = "en"
    speed: float = 1.0
    pitch: int | None = None  # 0..100; None keeps eSpeak's default (50)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field; a Struct built directly is not type-checked."""
        if not isinstance(self.voice, str) or not self.voice.strip() or "\x00" in self.voice:
            raise ValueError(f"voice must be a non-empty string, got {self.voice!r}")
        speed = self.speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be a number in [0.25, 4.0], got {speed!r}")
        pitch = self.pitch
        if pitch is not None and (isinstance(pitch, bool) or not isinstance(pitch, int) or not 0 <= pitch <= 100):
            raise ValueError(f"pitch must be an integer in [0, 100] or null, got {pitch!r}")


def speech_params(raw: Any, default_voice: str) -> SpeechParams:
    """A speech stage's params from what a request carries: None or a vLLM ``SamplingParams``
    (vLLM-Omni callers pass one for every stage; it says nothing about speech) mean the defaults;
    a dict fills in ``default_voice``. Unchecked: the caller validates."""
    if raw is None or is_llm_sampling_params(raw):
        return SpeechParams(voice=default_voice)
    if isinstance(raw, SpeechParams):
        return raw
    if isinstance(raw, Mapping):
        return msgspec.convert({"voice": default_voice, **raw}, SpeechParams)
    raise TypeError(f"speech params must be None, a dict, SpeechParams or SamplingParams (defaults), "
                    f"got {type(raw).__name__}")


def parse_output_kind(kind: Any) -> Any:
    """A ``RequestOutputKind`` from a config value: a name ("delta", "cumulative",
    "final_only") or a number; anything else is passed on for vLLM to judge."""
    from vllm.sampling_params import RequestOutputKind

    if isinstance(kind, str):
        try:
            return RequestOutputKind[kind.upper()]
        except KeyError:
            raise ValueError(f"invalid sampling_params.output_kind {kind!r}; use delta, cumulative "
                             "or final_only") from None
    if isinstance(kind, int):
        return RequestOutputKind(kind)
    return kind


def merged_params(base: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """``entry``'s fields over ``base``'s (a request's per-stage params over the stage's), with
    ``extra_args`` merged the same way rather than replaced: a voice given keeps the stage's other
    extra args."""
    merged = {**base, **entry}
    if isinstance(entry.get("extra_args"), Mapping) and isinstance(base.get("extra_args"), Mapping):
        merged["extra_args"] = {**base["extra_args"], **entry["extra_args"]}
    return merged


def to_sampling_params(value: Any) -> SamplingParams:
    """``SamplingParams`` from what a caller or a stage config gives.

    Config dicts may name the output kind ("delta", "cumulative", "final_only").
    """
    from vllm.sampling_params import SamplingParams

    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        kwargs = dict(value)
        if "output_kind" in kwargs:
            kwargs["output_kind"] = parse_output_kind(kwargs["output_kind"])
        try:
            return SamplingParams(**kwargs)
        except TypeError as exc:
            raise ValueError(f"invalid sampling_params: {exc}") from exc
    raise TypeError(f"sampling_params for an llm stage must be SamplingParams or a dict, got {type(value).__name__}")
