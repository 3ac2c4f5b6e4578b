"""Outputs of a pipeline stage.

``OmniRequestOutput`` *is* a vLLM ``RequestOutput`` so vLLM's serving code reads
text-stage outputs unchanged; audio, images and tensors ride along in
``multimodal_output``.
"""

from __future__ import annotations

from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput

# A speech output's ``multimodal_output`` key for the text it speaks: the edge's input processor
# cuts a reply into pieces (sentences, or a live voice's first fragment), and whoever plays the
# audio learns from this exactly what was said, whatever the cut.
SPOKEN_TEXT = "transcript"

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


class OmniRequestOutput(RequestOutput):
    """A stage's output for one request.

    ``final_output_type`` says what the caller should look at: "text" (the
    ``outputs`` of the RequestOutput), "audio" (``multimodal_output["audio"]``
    and ``["sample_rate"]``), "image", or "latent"/"tensor".
    ``stage_versions``: stage id -> the weight versions that made this output and
    what it was made from (an audio chunk made from text of version v says v at
    the text stage); empty where no stage has versioned weights.
    """

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
