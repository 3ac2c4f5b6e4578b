"""The contract for non-autoregressive "generation" stage models (TTS, vocoders, ...).

A generation stage names a factory by dotted path (``engine_args.model_factory``);
the factory is called with the remaining ``engine_args`` and returns a
``GenerationModel``. ``GenerationStageEngine`` batches concurrent requests up to
``runtime.max_batch_size`` and calls ``generate`` once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class GenerationRequest:
    """One request as a generation model sees it."""

    request_id: str
    # The text (or structured input) to render; a str, or a dict with "prompt".
    prompt: Any
    # Per-request parameters (e.g. SpeechParams for TTS); None means defaults.
    params: Any = None
    # Set by the engine when the request is aborted; a model that works in
    # chunks may check it to stop early.
    aborted: bool = field(default=False)


@runtime_checkable
class GenerationModel(Protocol):
    """A batched, async model. One result per request, in order.

    A result is a dict that becomes ``OmniRequestOutput.multimodal_output``,
    e.g. ``{"audio": np.ndarray[float32], "sample_rate": 22050}``. An
    ``Exception`` instance in place of a result fails that request alone;
    raising fails the whole batch.
    """

    output_type: str  # "audio", "image", ...

    async def generate(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]: ...

    def info(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...
