"""What a stage process answers with, in a module that imports no vLLM.

The client reads every stage output as an ``OmniRequestOutput`` (a vLLM
``RequestOutput``, so vLLM's serving code reads it unchanged). A stage that runs
no vLLM engine (eSpeak, Piper, the GANs, diffusers) must not pay vLLM's import
(5-24 s and a few hundred MB) to say that, so it answers with
``StageRequestOutput``: the same attributes, sent as the same wire message
(ext 100), decoded by the client into an ``OmniRequestOutput``. An llm stage
sends vLLM's own outputs (wrapped, not copied); the wire treats both alike.
"""

from __future__ import annotations

from typing import Any

# A speech output's ``multimodal_output`` key for the text it speaks: the edge's input processor
# cuts a reply into pieces (sentences, or a live voice's first fragment), and whoever plays the
# audio learns from this exactly what was said, whatever the cut.
SPOKEN_TEXT = "transcript"

# A piece's prompt key for how many seconds of speech it will give, where that is known before it is
# made (a codec piece: its codes times the codec's frame time). The orchestrator's playback clock
# then gives the pieces after it their real deadlines, not its own, before any audio exists.
SPOKEN_SECONDS = "spoken_seconds"

# The RequestOutput attributes that travel on the wire, in wire order. Adding
# a field means appending here; never reorder (older peers decode by position).
REQUEST_OUTPUT_FIELDS: tuple[str, ...] = (
    "request_id",
    "prompt",
    "prompt_token_ids",
    "prompt_logprobs",
    "outputs",
    "finished",
    "metrics",
    "lora_request",
    "encoder_prompt",
    "encoder_prompt_token_ids",
    "num_cached_tokens",
    "num_cache_creation_tokens",
    "prompt_token_id_logprobs",
    "kv_transfer_params",
    "ec_transfer_params",
)

# After them, the stage fields of an OmniRequestOutput; a peer must send the first three
# (stage_versions was appended later and defaults when absent).
OMNI_OUTPUT_FIELDS: tuple[str, ...] = ("stage_id", "final_output_type", "multimodal_output", "stage_versions")
OMNI_REQUIRED_FIELDS = 3

# vLLM's CompletionOutput dataclass fields, in its order: the wire sends a completion as this
# tuple and the client rebuilds vLLM's class from it by position. A test holds this to vLLM's own
# ``dataclasses.fields`` (vLLM is pinned, so the two move together).
COMPLETION_OUTPUT_FIELDS: tuple[str, ...] = (
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "routed_experts",
    "finish_reason",
    "stop_reason",
    "lora_request",
    "sampling_mask",
    "spec_decode_metrics",
    "weight_versions",
)


class StageCompletionOutput:
    """One completion of a stage's output, as vLLM's ``CompletionOutput`` has it (wire ext 109)."""

    __slots__ = COMPLETION_OUTPUT_FIELDS

    def __init__(self, index: int, text: str, token_ids: list[int], cumulative_logprob: float | None = None,
                 logprobs: Any = None, routed_experts: Any = None, finish_reason: str | None = None,
                 stop_reason: int | str | None = None, lora_request: Any = None, sampling_mask: Any = None,
                 spec_decode_metrics: Any = None, weight_versions: Any = None) -> None:
        self.index = index
        self.text = text
        self.token_ids = token_ids
        self.cumulative_logprob = cumulative_logprob
        self.logprobs = logprobs
        self.routed_experts = routed_experts
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.lora_request = lora_request
        self.sampling_mask = sampling_mask
        self.spec_decode_metrics = spec_decode_metrics
        self.weight_versions = weight_versions

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"StageCompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason})")


class StageRequestOutput:
    """A stage's output for one request, built where vLLM is not imported (wire ext 100).

    The attributes are ``OmniRequestOutput``'s; those of ``REQUEST_OUTPUT_FIELDS`` a
    stage without an LLM has no use for are None, as vLLM's own defaults are.
    """

    def __init__(self, request_id: str, *, outputs: list[Any] | None = None, finished: bool = False,
                 stage_id: int = 0, final_output_type: str = "text",
                 multimodal_output: dict[str, Any] | None = None,
                 stage_versions: dict[int, list[str]] | None = None, **fields: Any) -> None:
        unknown = set(fields).difference(REQUEST_OUTPUT_FIELDS)
        if unknown:
            raise TypeError(f"StageRequestOutput got unknown fields {sorted(unknown)}")
        for name in REQUEST_OUTPUT_FIELDS:
            setattr(self, name, fields.get(name))
        self.request_id = request_id
        self.outputs = outputs if outputs is not None else []
        self.finished = finished
        self.stage_id = stage_id
        self.final_output_type = final_output_type
        self.multimodal_output = multimodal_output if multimodal_output is not None else {}
        self.stage_versions = stage_versions if stage_versions is not None else {}

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    def __repr__(self) -> str:
        mm = {k: type(v).__name__ for k, v in self.multimodal_output.items()}
        return (f"StageRequestOutput(request_id={self.request_id!r}, stage_id={self.stage_id}, "
                f"final_output_type={self.final_output_type!r}, finished={self.finished}, "
                f"outputs={self.outputs!r}, multimodal_output={mm})")


def aborted_stage_output(request_id: str, stage_id: int, final_output_type: str = "text") -> StageRequestOutput:
    """The final output a stage sends for an aborted request whose engine gave none: as vLLM's
    own abort output without partial text (``finished``, one empty completion, ``finish_reason="abort"``)."""
    return StageRequestOutput(request_id, outputs=[StageCompletionOutput(0, "", [], finish_reason="abort")],
                              finished=True, stage_id=stage_id, final_output_type=final_output_type)


def audio_seconds(output: Any) -> float:
    """Seconds of audio in an output's ``multimodal_output`` (0 without audio): what a listener
    hears of it (the playback clock) and what a stage span reports (traces)."""
    media = getattr(output, "multimodal_output", None)
    audio = media.get("audio") if media else None
    rate = media.get("sample_rate") if audio is not None else None
    shape = getattr(audio, "shape", None)
    return shape[-1] / float(rate) if rate and shape else 0.0
