"""The interface every stage engine implements.

A stage process (``StageEngineCoreProc``) hosts exactly one ``StageEngine``.
The process owns the sockets and the event loop; the engine owns the model.
Keeping this interface small is what lets an LLM, a speech synthesizer and a
diffusion model sit behind the same wire protocol.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from omni_engine.outputs import OmniRequestOutput
    from omni_engine.stage_output import StageRequestOutput


class StageEngineError(Exception):
    """An engine failure that is fatal for the whole stage (the stage sends DEAD)."""


class StageEngine(abc.ABC):
    """One model behind one stage process."""

    # Methods a client may call through UTILITY messages; nothing else is
    # reachable from the wire.
    UTILITY_METHODS: ClassVar[frozenset[str]] = frozenset({"info", "num_unfinished_requests"})
    # Whether the engine runs vLLM. One that does not is never made to import it: its stage
    # decodes vLLM's types to neutral ones (``StageMsgpackDecoder(vllm_types=False)``) and it
    # answers with ``StageRequestOutput``, so it starts in seconds instead of vLLM's import time.
    USES_VLLM: ClassVar[bool] = False

    def __init__(self, stage_id: int) -> None:
        self.stage_id = stage_id
        # Set by the stage once a request is traced: ``(request_id, at)`` when the engine's work on
        # a request begins (``at``: wall-clock seconds, None for now). None: nobody asks, no cost.
        self.on_work_started: Callable[[str, float | None], None] | None = None
        # A traced request's W3C trace headers, for an engine that hands them on (vLLM's own
        # request span); taken (popped) by that engine, dropped by the stage when the request ends.
        self.trace_headers: dict[str, dict[str, str]] = {}
        # A request's LoRA adapter (vLLM's LoRARequest), for an engine that runs them (``USES_VLLM``);
        # taken (popped) by that engine when the request starts, dropped by the stage when it ends.
        self.lora_requests: dict[str, Any] = {}
        # Set by the stage once the engine has started: the engine calls it when it can no longer
        # serve and no request would tell (a process it depends on died while idle, or under a
        # utility call). The stage sends DEAD and exits.
        self.on_fatal: Callable[[BaseException], None] | None = None

    async def start(self) -> None:
        """Load the model. Runs inside the stage's event loop, before READY."""

    @abc.abstractmethod
    def generate(
        self, request_id: str, prompt: Any, sampling_params: Any, deadline: float | None = None
    ) -> AsyncIterator[OmniRequestOutput | StageRequestOutput]:
        """Stream the outputs of one request; the last one has ``finished=True``.

        ``deadline`` (``time.time()`` seconds, None: no hurry) is when its output is needed: an
        engine with a queue serves the earliest first (``omni_engine.deadlines``).

        An exception raised here fails this request only (the stage sends
        ERROR for it); raise ``StageEngineError`` when the engine as a whole
        can no longer serve.
        """

    def submit(self, request_id: str, prompt: Any, sampling_params: Any,
               deadline: float | None = None) -> asyncio.Future | None:
        """Take a request whose one output is its final one, without a task of its own.

        Returns a future of that ``OmniRequestOutput`` (an exception fails the request as one
        raised by ``generate`` does; cancelling the future aborts the request), or None where
        the engine streams, and the stage then runs ``generate`` in a task. A task per request
        costs a stage ~10 us of CPU and a loop turn before the request is even queued; a batched
        model answering thousands of small requests a second spends more on that than on itself.
        """
        return None

    def open_request(self, request_id: str, *, input_stream: bool, stream_states: bool) -> None:
        """Before ``generate``: the request's input comes in parts (``extend_input``), or its partial
        outputs carry the states written since the last one. An engine that cannot refuses here."""
        raise ValueError(f"stage {self.stage_id} ({type(self).__name__}): request {request_id!r}: this stage "
                         "takes no input in parts and streams no states (an llm stage does)")

    def extend_input(self, request_id: str, prompt: Any, *, last: bool) -> None:
        """The next part of an opened request's input; ``last``: it ends there."""
        raise ValueError(f"stage {self.stage_id} ({type(self).__name__}): request {request_id!r}: "
                         "this stage takes no input in parts")

    def close_request(self, request_id: str) -> None:
        """An opened request has ended (finished, failed or aborted, perhaps before ``generate``)."""

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Stop the given requests; unknown ids are ignored."""

    @property
    def output_type(self) -> str:
        """What this engine's outputs carry ("text", "audio", ...)."""
        return "text"

    def info(self) -> dict[str, Any]:
        """Facts sent to the client in READY (model name, sample rate, ...)."""
        return {}

    def watch_loop_holds(self) -> Any:
        """Report model steps that hold the event loop (called where the loop is shared with the
        client); returns the report, or None where the engine has no model steps of its own to time."""
        return None

    def num_unfinished_requests(self) -> int:
        return 0

    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""

    async def shutdown(self) -> None:
        """Release the model; idempotent."""
