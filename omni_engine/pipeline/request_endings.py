"""The end of a request: abort, failure and finish, for one orchestrator.

``RequestEndings`` is the orchestrator's collaborator for the end of a request,
kept apart from routing because ending is where the state of every stage, the
caller's stream and the stage clients meet: ``abort`` (vLLM's ``AsyncLLM.abort``
contract: the stream ends with the stages' final partial outputs), a request
failing (``fail``, ``fail_stage``), and ``finish``, the one place a request's
state is freed. It shares the orchestrator's request table and routes (handed
to its constructor).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from omni_engine.errors import StageDeadError
from omni_engine.outputs import aborted_output
from omni_engine.pipeline.request_events import RequestEventRecorder
from omni_engine.pipeline.request_state import ClientRequestState

if TYPE_CHECKING:
    from omni_engine.pipeline.stage_context import StageContext

logger = logging.getLogger(__name__)


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
