"""Outputs of a pipeline stage.

``OmniRequestOutput`` *is* a vLLM ``RequestOutput`` so vLLM's serving code reads
text-stage outputs unchanged; audio, images and tensors ride along in
``multimodal_output``. The client side's type: a stage that runs no vLLM answers
with ``omni_engine.stage_output.StageRequestOutput``, which the wire turns into this.
"""

from __future__ import annotations

from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput

# Re-exported: the client's code has always found them here.
from omni_engine.stage_output import (  # noqa: F401
    COMPLETION_OUTPUT_FIELDS,
    REQUEST_OUTPUT_FIELDS,
    SPOKEN_TEXT,
    StageCompletionOutput,
    StageRequestOutput,
)
from omni_engine.tracing.stage_timing import StageTiming


class OmniRequestOutput(RequestOutput):
    """A stage's output for one request.

    ``final_output_type`` says what the caller should look at: "text" (the
    ``outputs`` of the RequestOutput), "audio" (``multimodal_output["audio"]``
    and ``["sample_rate"]``), "image", or "latent"/"tensor".
    ``stage_versions``: stage id -> the weight versions that made this output and
    what it was made from (an audio chunk made from text of version v says v at
    the text stage); empty where no stage has versioned weights.
    """

    # What the stage recorded of a traced request, on its final output (omni_engine.tracing).
    stage_timing: StageTiming | None = None

    def __init__(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        prompt_logprobs: Any = None,
        outputs: list[CompletionOutput] | None = None,
        finished: bool = False,
        *args: Any,
        stage_id: int = 0,
        final_output_type: str = "text",
        multimodal_output: dict[str, Any] | None = None,
        stage_versions: dict[int, list[str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            request_id, prompt, prompt_token_ids, prompt_logprobs,
            outputs if outputs is not None else [], finished, *args, **kwargs,
        )
        self.stage_id = stage_id
        self.final_output_type = final_output_type
        self.multimodal_output = multimodal_output if multimodal_output is not None else {}
        self.stage_versions = stage_versions if stage_versions is not None else {}

    @classmethod
    def from_request_output(
        cls, output: RequestOutput, *, stage_id: int, final_output_type: str = "text"
    ) -> "OmniRequestOutput":
        """Wrap a vLLM output without copying its token lists."""
        new = cls.__new__(cls)
        new.__dict__.update(output.__dict__)
        new.stage_id = stage_id
        new.final_output_type = final_output_type
        new.multimodal_output = getattr(output, "multimodal_output", None) or {}
        new.stage_versions = getattr(output, "stage_versions", None) or {}
        return new

    @property
    def text(self) -> str:
        """Text of the first completion ('' for non-text stages)."""
        return self.outputs[0].text if self.outputs else ""

    def __repr__(self) -> str:
        mm = {k: type(v).__name__ for k, v in self.multimodal_output.items()}
        return (
            f"OmniRequestOutput(request_id={self.request_id!r}, stage_id={self.stage_id}, "
            f"final_output_type={self.final_output_type!r}, finished={self.finished}, "
            f"outputs={self.outputs!r}, multimodal_output={mm})"
        )


def as_omni_request_output(output: Any) -> Any:
    """The client's ``OmniRequestOutput`` of a stage output that did not cross the wire (the
    legacy queues pickle what the stage made: a ``StageRequestOutput`` where it runs no vLLM);
    anything else is returned as it is."""
    if not isinstance(output, StageRequestOutput):
        return output
    new = OmniRequestOutput.__new__(OmniRequestOutput)
    new.__dict__.update(output.__dict__)
    new.outputs = [CompletionOutput(*(getattr(c, name) for name in COMPLETION_OUTPUT_FIELDS))
                   if isinstance(c, StageCompletionOutput) else c for c in output.outputs]
    return new


def aborted_output(request_id: str, stage_id: int, final_output_type: str = "text",
                   last: RequestOutput | None = None) -> OmniRequestOutput:
    """The final output of an aborted request, for an engine that did not give one.

    As vLLM's own abort output: ``finished``, ``finish_reason="abort"`` on every
    completion. ``last`` (a cumulative output seen before) gives the partial
    text and tokens; without it the completion is empty (a DELTA stream's final
    delta, or a stage without text).
    """
    completions = [
        CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob, c.logprobs,
                         finish_reason="abort")
        for c in (last.outputs if last is not None else []) if c.finish_reason is None
    ] or [CompletionOutput(0, "", [], None, None, finish_reason="abort")]
    return OmniRequestOutput(
        request_id, getattr(last, "prompt", None), getattr(last, "prompt_token_ids", None), None, completions,
        True, stage_id=stage_id, final_output_type=final_output_type)
