"""The contract for non-autoregressive "generation" stage models (TTS, vocoders, ...).

A generation stage names a factory by dotted path (``engine_args.model_factory``);
the factory is called with the remaining ``engine_args`` and returns a
``GenerationModel``. ``GenerationStageEngine`` batches concurrent requests up to
``runtime.max_batch_size`` and calls ``generate`` once per batch.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
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
    # Optional (default False): True for a model that renders a batch one request after another
    # anyway; the engine then hands it one request at a time, earliest deadline first.
    # renders_alone: bool
    # Optional: ``batch_key(request) -> Hashable``, for a model that renders in one pass only
    # requests of one key (windows of one length); the engine then batches the earliest-deadline
    # request with queued requests of its key alone, so each pass's answers leave when it ends.
    # def batch_key(self, request: GenerationRequest) -> Hashable: ...

    async def generate(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]: ...

    def info(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...


class ThreadedGenerationModel:
    """A base for models whose work blocks: one worker thread per model, so the stage's loop never
    blocks and batches run in order. Subclasses render one request (``_render``) or a batch
    (``_render_batch``); an exception fails that request alone."""

    # One request at a time (``_render``): the engine hands over one at a time, choosing the
    # earliest deadline after each. A subclass whose ``_render_batch`` really batches sets False.
    renders_alone = True

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    def _render(self, request: GenerationRequest) -> dict[str, Any]:
        raise NotImplementedError

    def _render_one(self, request: GenerationRequest) -> dict[str, Any] | Exception:
        if request.aborted:
            return RuntimeError("aborted")
        try:
            return self._render(request)
        except Exception as exc:  # the protocol fails this request alone
            return exc

    def _render_batch(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        return [self._render_one(r) for r in requests]

    async def generate(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is shut down")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._render_batch, list(requests))

    async def shutdown(self) -> None:
        """Drop queued batches and wait for the running one off-loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True)
