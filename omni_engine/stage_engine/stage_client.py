"""``StageClient``: what the pipeline uses of one stage, declared once.

Two things implement it: a client of one stage process (``BaseStageClient`` and
its transports: ZMQ, in-process, Ray, the legacy queues) and
``StageReplicaSet`` (N replicas of one stage behind the same methods). The
orchestrator, the supervisor, the weight fence and the server talk to a stage
only through these methods, so they cannot tell one replica from many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from omni_engine.errors import StageDeadError, StageRequestError
from omni_engine.outputs import OmniRequestOutput
from omni_engine.wire.protocol import StageReady

# What a stage client delivers per request: an output, a request's error, or (from a
# replica set) a request lost with the replica that ran it.
StageItem = OmniRequestOutput | StageRequestError | StageDeadError


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica as metrics and operators see it."""

    alive: bool
    in_flight: int  # requests submitted and not finished
    submitted: int  # requests sent to it, resubmissions included
    pid: int | None
    host_id: str | None = None  # where it runs (its READY's: a machine, or a Ray node)


@runtime_checkable
class StageClient(Protocol):
    """Submit, stream outputs, abort, health and utility calls, and shutdown of one stage."""

    stage_id: int

    # ---------------------------------------------------------------- state
    @property
    def ready(self) -> StageReady | None:
        """The stage's READY (its pid and engine info); None before it started."""

    @property
    def dead_error(self) -> StageDeadError | None:
        """Why the stage cannot serve (every replica dead, or shut down); None while it serves."""

    @property
    def is_dead(self) -> bool: ...

    @property
    def bytes_sent(self) -> int:
        """Wire traffic to the stage, for metrics (0 where the transport cannot count)."""

    @property
    def bytes_received(self) -> int: ...

    @property
    def resubmitted(self) -> int:
        """Requests moved to another replica when theirs died (0 for one replica)."""

    @property
    def replicas(self) -> Sequence[StageClient]:
        """The client of each replica (a client of one stage process: itself)."""

    def replica_status(self) -> list[ReplicaStatus]:
        """Per replica: alive, requests in flight, requests sent to it, pid, host."""

    def num_unfinished_requests(self) -> int: ...

    def state_counts(self) -> dict[str, int]:
        """What the client holds per request (``in_flight``, ``held``, ``queued``): all 0 when idle."""

    # ------------------------------------------------------------- requests
    async def submit_request(self, request_id: str, prompt: Any, sampling_params: Any = None, *,
                             end_on_finish: bool = True, group: str | None = None,
                             trace: dict[str, str] | None = None, deadline: float | None = None,
                             input_stream: bool = False, stream_states: bool = False,
                             lora_request: Any = None) -> None:
        """Send a GENERATE. With ``end_on_finish`` False what the request holds (shared-memory
        slots of its outputs) stays held after it finishes, until ``end_request``. ``group``: the
        request a sub-request belongs to (a replica set may keep a group on one replica).
        ``trace``: W3C trace headers; the final output then carries the stage's ``stage_timing``.
        ``deadline``: when the output is needed (``time.time()`` seconds): earliest first.
        ``input_stream``: more input follows (``extend_request``); ``stream_states``: partial
        outputs carry the states written since the last one. ``lora_request``: vLLM's LoRARequest
        (an llm stage with ``enable_lora``)."""

    async def extend_request(self, request_id: str, prompt: Any, *, last: bool) -> bool:
        """Append to the input of an ``input_stream`` request, on the replica running it; ``last``
        ends its input. False (nothing sent) where it has ended."""

    async def abort_request(self, request_ids: str | Sequence[str], *, keep_final: bool = False) -> None:
        """Abort in the stage; with ``keep_final`` the final (aborted) output is still delivered."""

    def end_request(self, request_id: str) -> None:
        """The pipeline is done with ``request_id``: free what is held for it."""

    async def get_outputs_async(self) -> list[StageItem]:
        """The next batch, outputs and per-request errors in stage order; ``StageDeadError`` once dead."""

    async def get_output_async(self) -> OmniRequestOutput: ...

    # -------------------------------------------------------- health, utility
    async def check_health(self, timeout: float = 10.0) -> None:
        """Raise ``StageDeadError`` unless the stage answers healthy within ``timeout``."""

    async def call_utility_async(self, utility: str, /, *args: Any, call_timeout: float | None = None,
                                 **kwargs: Any) -> Any:
        """Call an engine method in the stage (every replica; the first live one's result stands)."""

    async def call_each_replica_async(self, utility: str, /, *args: Any, call_timeout: float | None = None,
                                      return_exceptions: bool = False, **kwargs: Any) -> dict[int, Any]:
        """``call_utility_async`` per live replica: replica index -> result."""

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None: ...

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the stage and free everything the client holds. Idempotent."""

    def ask_stop_now(self) -> bool:
        """First half of a synchronous shutdown: ask the stage to exit, without awaiting.
        False if it was stopping already (see ``omni_engine.loop_context``)."""

    def finish_shutdown_now(self, timeout: float) -> None:
        """Second half: ``timeout`` for the exit asked for, then kill; free what is held."""
