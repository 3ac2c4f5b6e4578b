"""The session object of OpenAI's Realtime API: its typed form, partial updates, and the beta names.

A ``session.update`` carries a *partial* session: it is merged into the current one (objects
field by field, an explicit ``null`` clears) and the result is checked as a whole, so a bad
update leaves the session as it was. The GA shape (``audio.input.format``, ``output_modalities``)
is what the server speaks; the beta names (``modalities``, ``input_audio_format: "pcm16"``,
``voice``, ``turn_detection``, ``input_audio_transcription``, ``max_response_output_tokens``) are
accepted on input because clients written for the beta still send them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

FORMAT_RATES = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


class SessionConfigError(ValueError):
    """A session (or response) setting that is refused; ``param`` is its path, e.g. ``session.audio.output.voice``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AudioFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=False):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: int | None = None

    @property
    def sample_rate(self) -> int:
        return FORMAT_RATES[self.type]

    def check(self, where: str) -> None:
        """A ``rate`` other than the format's own is refused (``where``: the field's path in the session)."""
        if self.rate is not None and self.rate != self.sample_rate:
            raise SessionConfigError(f"{where}.rate must be {self.sample_rate} for {self.type}, got {self.rate}",
                                     f"session.{where}.rate")


class TranscriptionConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = "whisper-1"
    language: str | None = None
    prompt: str | None = None


class TurnDetection(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    eagerness: str | None = None


class AudioInput(msgspec.Struct, forbid_unknown_fields=True):
    format: AudioFormat = msgspec.field(default_factory=AudioFormat)
    transcription: TranscriptionConfig | None = msgspec.field(default_factory=TranscriptionConfig)
    turn_detection: TurnDetection | None = msgspec.field(default_factory=TurnDetection)
    noise_reduction: dict[str, Any] | None = None


class AudioOutput(msgspec.Struct, forbid_unknown_fields=True):
    format: AudioFormat = msgspec.field(default_factory=AudioFormat)
    voice: str = "alloy"
    speed: float = 1.0


class AudioConfig(msgspec.Struct, forbid_unknown_fields=True):
    input: AudioInput = msgspec.field(default_factory=AudioInput)
    output: AudioOutput = msgspec.field(default_factory=AudioOutput)


class SessionConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A realtime session's settings (OpenAI's GA session object; ``temperature`` is the beta's)."""

    model: str = ""
    type: Literal["realtime"] = "realtime"
    instructions: str = ""  # empty: the LLM's chat template supplies its own system prompt
    output_modalities: list[Literal["text", "audio"]] = msgspec.field(default_factory=lambda: ["audio"])
    audio: AudioConfig = msgspec.field(default_factory=AudioConfig)
    max_output_tokens: int | Literal["inf"] = "inf"
    temperature: float | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)  # checked by realtime.tools
    tool_choice: str | dict[str, Any] = "auto"
    # Accepted and echoed, nothing acts on them (tracing, include, truncation: the server keeps no traces,
    # sends no logprobs and cuts the history itself); a stored ``prompt`` is refused in ``check``.
    tracing: Any = None
    include: list[str] | None = None
    truncation: Any = "auto"
    parallel_tool_calls: bool | None = None
    prompt: Any = None

    def check(self) -> None:
        """Range checks msgspec's types do not express; ``SessionConfigError`` names the field."""
        self.audio.input.format.check("audio.input.format")
        self.audio.output.format.check("audio.output.format")
        td = self.audio.input.turn_detection
        if td is not None:
            if td.type != "server_vad":
                raise SessionConfigError(f"turn_detection type {td.type!r} is not supported; use 'server_vad' or null",
                                         "session.audio.input.turn_detection.type")
            for name, value, low, high in (("threshold", td.threshold, 0.0, 1.0),
                                           ("prefix_padding_ms", td.prefix_padding_ms, 0, 10_000),
                                           ("silence_duration_ms", td.silence_duration_ms, 0, 10_000)):
                if not low <= value <= high:
                    raise SessionConfigError(f"turn_detection.{name} must be in [{low}, {high}], got {value}",
                                             f"session.audio.input.turn_detection.{name}")
            if td.idle_timeout_ms is not None:
                raise SessionConfigError("turn_detection.idle_timeout_ms is not supported; leave it null",
                                         "session.audio.input.turn_detection.idle_timeout_ms")
        if self.prompt is not None:
            raise SessionConfigError("stored prompts are not supported; give instructions instead", "session.prompt")
        if self.audio.input.noise_reduction is not None:
            raise SessionConfigError("noise_reduction is not supported; set it to null",
                                     "session.audio.input.noise_reduction")
        if not self.output_modalities or len(set(self.output_modalities)) != len(self.output_modalities):
            raise SessionConfigError("output_modalities must be ['audio'] or ['text']", "session.output_modalities")
        if isinstance(self.max_output_tokens, int) and not 1 <= self.max_output_tokens <= 4096:
            raise SessionConfigError(f"max_output_tokens must be in [1, 4096] or 'inf', got {self.max_output_tokens}",
                                     "session.max_output_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise SessionConfigError(f"temperature must be in [0, 2], got {self.temperature}", "session.temperature")
        if not 0.25 <= self.audio.output.speed <= 4.0:
            raise SessionConfigError(f"speed must be in [0.25, 4.0], got {self.audio.output.speed}",
                                     "session.audio.output.speed")

    def to_json(self, session_id: str) -> dict[str, Any]:
        body = msgspec.to_builtins(self)
        for side in ("input", "output"):
            fmt = body["audio"][side]["format"]
            fmt["rate"] = FORMAT_RATES[fmt["type"]] if fmt["type"] == "audio/pcm" else None
        return {"id": session_id, "object": "realtime.session", **body}


def _beta_to_ga(update: dict[str, Any]) -> dict[str, Any]:
    """The beta session names moved to where the GA session has them (GA names win when both are given)."""
    update = dict(update)
    audio: dict[str, Any] = {}
    inp: dict[str, Any] = {}
    out: dict[str, Any] = {}
    if "modalities" in update:
        mods = update.pop("modalities")
        update.setdefault("output_modalities", ["audio"] if isinstance(mods, list) and "audio" in mods else mods)
    if "max_response_output_tokens" in update:
        update.setdefault("max_output_tokens", update.pop("max_response_output_tokens"))
    for beta, target, key in (("input_audio_format", inp, "format"), ("output_audio_format", out, "format")):
        if beta in update:
            value = update.pop(beta)
            target[key] = {"type": BETA_FORMATS.get(value, value)} if isinstance(value, str) else value
    for beta, target, key in (("turn_detection", inp, "turn_detection"),
                              ("input_audio_transcription", inp, "transcription"),
                              ("input_audio_noise_reduction", inp, "noise_reduction"),
                              ("voice", out, "voice"), ("speed", out, "speed")):
        if beta in update:
            target[key] = update.pop(beta)
    if inp:
        audio["input"] = inp
    if out:
        audio["output"] = out
    if audio:
        update["audio"] = _merge(audio, update.get("audio") or {})
    update.pop("object", None)
    update.pop("id", None)
    update.pop("expires_at", None)
    update.pop("client_secret", None)
    return update


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: objects merged key by key, anything else (``null`` too) replaced."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "format":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


_AT = re.compile(r" - at `\$\.?(.*)`$")


def validation_error(exc: msgspec.ValidationError, root: str = "session") -> SessionConfigError:
    """msgspec's complaint as a ``SessionConfigError`` whose ``param`` is the field's path under ``root``."""
    message = str(exc)
    match = _AT.search(message)
    path = match.group(1) if match else ""
    if field := re.search(r"unknown field `([^`]*)`", message):
        path = ".".join(p for p in (path, field.group(1)) if p)
    param = f"{root}.{path}" if path else root
    return SessionConfigError(f"invalid {root}: {_AT.sub('', message)}" + (f" at {param}" if path else ""), param)


def updated(config: SessionConfig, update: Any) -> SessionConfig:
    """``config`` with the partial session ``update`` applied and checked (``SessionConfigError`` otherwise)."""
    if not isinstance(update, dict):
        raise SessionConfigError("session must be an object", "session")
    merged = _merge(msgspec.to_builtins(config), _beta_to_ga(update))
    try:
        new = msgspec.convert(merged, SessionConfig)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    new.check()
    return new
