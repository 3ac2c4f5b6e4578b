"""One request of the orchestrator, from submit to its one ending.

``ClientRequestState`` (what each stage has done for it, the caller's queue)
and ``RequestEndings``, the orchestrator's collaborator for the end of a
request, kept apart from routing because ending is where the state of every
stage, the caller's stream and the stage clients meet: ``abort`` (vLLM's
``AsyncLLM.abort`` contract: the stream ends with the stages' final partial
outputs), a request failing (``fail``, ``fail_stage``), and ``finish``, the one
place a request's state is freed. It shares the orchestrator's request table
and routes (handed to its constructor).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.sampling_params import RequestOutputKind

from omni_engine.errors import StageDeadError
from omni_engine.metrics import OrchestratorMetrics, RequestEventRecorder, RequestMetrics
from omni_engine.outputs import OmniRequestOutput, aborted_output

if TYPE_CHECKING:
    from omni_engine.pipeline.stage_context import StageContext
    from omni_engine.pipeline.stage_graph import EdgeInputs

logger = logging.getLogger(__name__)


@dataclass
class StageTrack:
    """One stage's part in one request."""

    # Sources that still have to finish before this stage gets (more) input.
    sources_pending: int
    # Consumers that have not yet been given this stage's outputs (on_finish).
    consumers_pending: int = 0
    # Sub-requests in flight: id -> chunk index k.
    inflight: dict[str, int] = field(default_factory=dict)
    # Output kind per in-flight sub-request, to turn outputs into new text.
    kinds: dict[str, RequestOutputKind] = field(default_factory=dict)
    # Text seen so far per (sub-request, completion index), for cumulative outputs.
    seen: dict[tuple[str, int], int] = field(default_factory=dict)
    submitted: int = 0
    # Every sub-request id ever sent to this stage (ended on the stage client at the end).
    sub_ids: list[str] = field(default_factory=list)
    text: str = ""
    # Outputs kept for consumers that start when this stage is done (sequential).
    outputs: list[OmniRequestOutput] = field(default_factory=list)
    submitted_at: dict[int, float] = field(default_factory=dict)
    first_output_at: dict[int, float] = field(default_factory=dict)
    # Delivery order to the caller: chunk next_emit goes out first; later ones wait.
    next_emit: int = 0
    held: dict[int, list[OmniRequestOutput]] = field(default_factory=dict)
    # The last cumulative text output of a final stage (an abort's partial answer).
    last_output: OmniRequestOutput | None = None
    closed: bool = False
    done: bool = False

    @property
    def complete(self) -> bool:
        """No more input will come and nothing is in flight."""
        return self.sources_pending == 0 and not self.inflight


@dataclass
class ClientRequestState:
    """A request in the pipeline: what each stage has done, and the caller's queue."""

    END: ClassVar[object] = object()

    request_id: str
    prompt: Any
    params: dict[int, Any]
    final_stages: frozenset[int]
    stages: dict[int, StageTrack]
    metrics: RequestMetrics
    pipeline_metrics: OrchestratorMetrics
    execution_mode: str = "sequential"
    # Per destination stage: the input processors of its edges, for this request.
    processors: dict[int, EdgeInputs] = field(default_factory=dict)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Set once the caller left too many outputs unread (the request is being failed).
    overflowed: bool = False
    # Set when the request ends (finished, failed or aborted): a routing step
    # that awaited meanwhile must not submit anything more for it.
    ended: bool = False
    # Set by abort_request: nothing new is submitted; the stages' final (partial)
    # outputs still come in and end the caller's stream.
    aborting: bool = False
    ended_event: asyncio.Event = field(default_factory=asyncio.Event)
    # Stage id -> the weight versions whose outputs this request used so far (every final
    # output carries them: audio made from text of version v says v).
    stage_versions: dict[int, list[str]] = field(default_factory=dict)

    def add_versions(self, versions: dict[int, list[str]]) -> None:
        for sid, names in versions.items():
            known = self.stage_versions.setdefault(sid, [])
            known.extend(v for v in names if v not in known)


def new_text_of(track: StageTrack, sub_id: str, output: OmniRequestOutput) -> str:
    """The text this output adds (first completion), whatever its output kind."""
    if not output.outputs:
        return ""
    completion = output.outputs[0]
    text = completion.text or ""
    if track.kinds.get(sub_id) is RequestOutputKind.DELTA:
        return text
    key = (sub_id, completion.index)
    seen = track.seen.get(key, 0)
    track.seen[key] = len(text)
    if output.finished:
        track.seen.pop(key, None)
    return text[seen:]



# Seconds abort_request waits for the stages' final outputs of an aborted request
# (they come at once; a stage that does not answer gets one made for it).
ABORT_WAIT_S = 5.0


class RequestAbortedError(asyncio.CancelledError):
    """The request was aborted (by ``abort_request`` or the caller leaving)."""


class RequestEndings:
    """Abort, failure and the end of the requests of one orchestrator."""

    def __init__(self, stages: Mapping[int, StageContext], requests: dict[str, ClientRequestState],
                 routes: dict[int, dict[str, ClientRequestState]], events: RequestEventRecorder,
                 on_idle: Callable[[], None]) -> None:
        """``requests`` (request id -> state) and ``routes`` (stage -> sub-request id -> state) are the
        orchestrator's own tables; ``on_idle`` is called when the last request ends."""
        self.stages = stages
        self.requests = requests
        self.routes = routes
        self.events = events
        self.on_idle = on_idle

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort the requests on every stage where they are in flight.

        As vLLM's ``AsyncLLM.abort``: each aborted stream ends with a final
        output per final stage that had started (``finish_reason="abort"``,
        the partial text and tokens), then stops. The stages send those
        outputs; a stage that has not within ``ABORT_WAIT_S`` gets one made
        from what it sent before. Unknown or finished ids are ignored.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        states = [s for rid in dict.fromkeys(ids) if (s := self.requests.get(rid)) is not None and not s.aborting]
        for state in states:
            state.aborting = True
            await self.abort_everywhere(state, keep_routes=True)
        if not states:
            return
        await asyncio.wait([asyncio.ensure_future(s.ended_event.wait()) for s in states], timeout=ABORT_WAIT_S)
        for state in states:
            if not state.ended:
                self.close_aborted(state)

    def close_aborted(self, state: ClientRequestState) -> None:
        """End an aborted request whose stages did not send their final outputs in time."""
        for sid in sorted(state.final_stages):
            track = state.stages[sid]
            if track.submitted and not track.closed:
                state.queue.put_nowait(aborted_output(state.request_id, sid, self.stages[sid].final_output_type,
                                                      track.last_output))
        for sid, track in state.stages.items():
            for sub_id in track.inflight:
                self.routes[sid].pop(sub_id, None)
            track.inflight.clear()
        self.finish(state)

    async def abort_everywhere(self, state: ClientRequestState, keep_routes: bool = False) -> None:
        """Abort the request's sub-requests in flight; ``keep_routes``: their final outputs are still routed."""
        for sid, track in state.stages.items():
            if not track.inflight:
                continue
            sub_ids = list(track.inflight)
            if not keep_routes:
                for sub_id in sub_ids:
                    self.routes[sid].pop(sub_id, None)
                track.inflight.clear()
            self.events.aborted(state, sid, len(sub_ids))
            client = self.stages[sid].client
            if not client.is_dead:
                try:
                    await client.abort_request(sub_ids, keep_final=keep_routes)
                except Exception:  # noqa: BLE001 - the stage may be dying; its client cleans up
                    logger.debug("abort of %s on stage %d failed", sub_ids, sid, exc_info=True)

    async def fail(self, state: ClientRequestState, error: BaseException) -> None:
        self.events.failed(state, error)
        await self.abort_everywhere(state)
        self.finish(state, error)

    async def fail_stage(self, sid: int, error: StageDeadError) -> None:
        """Every request that needs ``sid`` and is not done with it fails, naming it."""
        for state in list(self.requests.values()):
            track = state.stages.get(sid)
            if track is not None and not track.done:
                await self.fail(state, error)

    def finish(self, state: ClientRequestState, error: BaseException | None = None) -> None:
        """End the request: the caller's stream ends (or raises); its memory is freed."""
        if self.requests.pop(state.request_id, None) is None:
            return
        state.ended = True
        if not self.requests:
            self.on_idle()
        for sid, track in state.stages.items():
            for sub_id in track.inflight:
                self.routes[sid].pop(sub_id, None)
        self.events.done(state, error if error is not None or not state.aborting
                         else RequestAbortedError(f"request {state.request_id!r} was aborted"))
        # Sub-requests were submitted with end_on_finish=False: their stage
        # clients keep them (and their shared-memory slots) until told here.
        for sid, track in state.stages.items():
            client = self.stages[sid].client
            for sub_id in track.sub_ids:
                client.end_request(sub_id)
        for track in state.stages.values():
            track.held.clear()
            track.outputs = []
        if error is not None:
            # Undelivered outputs are moot now; dropping them frees their
            # shared-memory slots at once instead of when the caller goes away.
            while not state.queue.empty():
                state.queue.get_nowait()
        state.queue.put_nowait(error if error is not None else ClientRequestState.END)
        state.ended_event.set()
