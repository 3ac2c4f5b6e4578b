"""``PipelineOrchestrator``: routes each request through the stage graph.

One asyncio task per stage reads that stage's outputs (a batch per message)
and routes every output by the request it belongs to: to the caller when the
stage is a final one, and to the stages it feeds, either chunk by chunk
(``async_chunk``) or once the source is done (``sequential``). There is no
polling loop anywhere: every task waits on a socket or a queue.

Requests downstream of the entry stage are *sub-requests*: in ``async_chunk``
mode a text stage's sentences become several speech requests. Sub-request k
of request R is called ``R`` (k = 0) or ``R#k`` in its stage; their outputs
reach the caller in k order, relabelled ``R``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from omni_engine.config import EdgeConfig
from omni_engine.errors import PipelineOverloadedError, StageDeadError, StageRequestError
from omni_engine.loop_context import cancel_now
from omni_engine.metrics import OrchestratorMetrics, PipelineObserver
from omni_engine.outputs import OmniRequestOutput
from omni_engine.params import parse_output_kind
from omni_engine.pipeline.input_processors import StageInput
from omni_engine.pipeline.playback_clock import PlaybackClock, speed_of
from omni_engine.pipeline.request_endings import ABORT_WAIT_S, RequestAbortedError, RequestEndings
from omni_engine.pipeline.request_events import RequestEventRecorder
from omni_engine.pipeline.request_state import ClientRequestState, StageTrack, new_text_of
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.pipeline.stage_graph import EXECUTION_MODES, RequestPlan, StageGraph
from omni_engine.stage_output import audio_seconds

if TYPE_CHECKING:
    from omni_engine.tracing.request_trace import PipelineTracer

logger = logging.getLogger(__name__)

# Request shapes (entry stage, final stages) whose graph plan is kept: all of them, in practice.
MAX_CACHED_PLANS = 256


class PipelineOrchestrator:
    """Runs requests through a graph of stages, each behind its own client."""

    def __init__(
        self,
        stages: Sequence[StageContext],
        execution_mode: str = "sequential",
        edges: Sequence[EdgeConfig] = (),
        metrics: OrchestratorMetrics | None = None,
        max_inflight_requests: int = 1024,
        max_undelivered_outputs: int = 4096,
    ) -> None:
        """``edges``: the pipeline's ``runtime.edges`` (per-edge mode and input processor)."""
        self.graph = StageGraph(stages, execution_mode, edges)
        self._plans: dict[tuple[Any, ...], RequestPlan] = {}
        self.stages = self.graph.contexts
        self.stage_order = self.graph.order
        self.sources = self.graph.sources
        self.consumers = self.graph.consumers
        self.execution_mode = execution_mode
        self.metrics = metrics or OrchestratorMetrics()
        # Bounds on what overload can make the client hold (see PipelineRuntimeConfig).
        self.max_inflight_requests = max_inflight_requests
        self.max_undelivered_outputs = max_undelivered_outputs
        self.events = RequestEventRecorder()
        # Opens the spans of every request when set (omni_engine.tracing.request_trace.PipelineTracer).
        self.tracer: PipelineTracer | None = None
        self._requests: dict[str, ClientRequestState] = {}
        # stage id -> sub-request id -> its request
        self._routes: dict[int, dict[str, ClientRequestState]] = {sid: {} for sid in self.stage_order}
        self._readers: dict[int, asyncio.Task] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.endings = RequestEndings(self.stages, self._requests, self._routes, self.events, self._on_idle)

    def edge_mode(self, src: int, dst: int, state: ClientRequestState | None = None) -> str:
        return self.graph.edge_mode(src, dst, state.execution_mode if state else None)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start one output reader per stage (idempotent; needs a running loop).

        Readers run while requests are in the pipeline and stop when it is
        idle, so an idle pipeline has no task at all, and another
        orchestrator may use the same stage clients afterwards.
        """
        for sid, ctx in self.stages.items():
            task = self._readers.get(sid)
            if task is None or task.done():
                self._readers[sid] = asyncio.create_task(self._read_stage(ctx), name=f"orchestrator-stage{sid}")

    def _on_idle(self) -> None:
        """The last request ended: no reader task is left running."""
        self._idle.set()
        current = asyncio.current_task()
        for sid, task in list(self._readers.items()):
            if task is not current:
                task.cancel()
                del self._readers[sid]

    async def stop(self) -> None:
        for task in self._readers.values():
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        self._readers.clear()
        for state in list(self._requests.values()):
            self.endings.finish(state, StageDeadError(-1, "pipeline is shut down"))

    def stop_now(self) -> None:
        """``stop`` without awaiting (a synchronous shutdown). Off the loop the requests' callers
        are gone with it: their state is dropped, not ended."""
        cancel_now(self._readers.values())
        self._readers.clear()
        for state in list(self._requests.values()):
            try:
                self.endings.finish(state, StageDeadError(-1, "pipeline is shut down"))
            except RuntimeError:  # no running loop: nobody can read the stream any more
                self._requests.pop(state.request_id, None)
                state.ended = True
        for routes in self._routes.values():
            routes.clear()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def state_counts(self) -> dict[str, int]:
        """What the orchestrator holds: all zero once the pipeline is idle.

        ``requests``: requests in the pipeline; ``routes``: sub-requests whose
        outputs it waits for; ``readers``: stage reader tasks still running.
        """
        return {"requests": len(self._requests), "routes": sum(len(r) for r in self._routes.values()),
                "readers": sum(1 for task in self._readers.values() if not task.done())}

    def request_ids(self) -> list[str]:
        return list(self._requests)

    async def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Abort requests on every stage where they are in flight (see ``RequestEndings.abort``)."""
        await self.endings.abort(request_id)

    async def wait_idle(self) -> None:
        """Return once no request is in the pipeline."""
        await self._idle.wait()

    def final_stage_ids(self) -> list[int]:
        return self.graph.final_stage_ids()

    def stage_load(self) -> dict[int, tuple[int, int]]:
        """Per stage: (waiting, running) sub-requests -- submitted with no output yet, and producing."""
        load = {sid: [0, 0] for sid in self.stage_order}
        for state in list(self._requests.values()):
            for sid, track in state.stages.items():
                for k in track.inflight.values():
                    load[sid][k in track.first_output_at] += 1
        return {sid: (w, r) for sid, (w, r) in load.items()}

    @property
    def observer(self) -> PipelineObserver | None:
        """Told of every event as it happens (e.g. a Prometheus exporter); optional."""
        return self.events.observer

    @observer.setter
    def observer(self, observer: PipelineObserver | None) -> None:
        self.events.observer = observer

    # --------------------------------------------------------------- submit
    async def submit_request(
        self,
        request_id: str,
        prompt: Any,
        params_by_stage: Mapping[int, Any] | None = None,
        final_stage_id: int | Sequence[int] | None = None,
        metrics: OrchestratorMetrics | None = None,
        execution_mode: str | None = None,
        entry_stage_id: int | None = None,
        trace_headers: Mapping[str, str] | None = None,
        deadline: float | None = None,
        lora_requests: Mapping[int, Any] | None = None,
    ) -> ClientRequestState:
        """Register the request and send it to its entry stage(s).

        ``params_by_stage`` maps stage ids to sampling params; a stage not in
        it uses its ``default_sampling_params``.

        ``execution_mode`` overrides the pipeline's for this request (edges
        with their own mode in the config keep it). ``entry_stage_id`` starts
        the request at that stage with ``prompt`` as its input, ignoring its
        sources (e.g. a speech stage alone); the final stages default to it.
        ``trace_headers``: the caller's W3C trace context, which the request's spans continue
        (when the orchestrator has a ``tracer``). ``deadline``: when its (first) output is needed,
        ``time.time()`` seconds; a request that ends in speech is stamped per piece (``PlaybackClock``)
        from it, or from now. ``lora_requests``: stage id -> the LoRA adapter (vLLM's LoRARequest)
        that stage's sub-requests run with (an llm stage with ``enable_lora``).
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the pipeline")
        if len(self._requests) >= self.max_inflight_requests:
            raise PipelineOverloadedError(
                f"request {request_id!r} refused: the pipeline already has {len(self._requests)} requests in "
                f"flight (runtime.max_inflight_requests); retry later", request_id)
        if execution_mode is not None and execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {EXECUTION_MODES}, got {execution_mode!r}")
        if entry_stage_id is not None and entry_stage_id not in self.stages:
            raise ValueError(f"entry_stage_id {entry_stage_id} not in the pipeline (stages {self.stage_order})")
        plan = self._plan(entry_stage_id, final_stage_id)
        used = plan.used
        for sid in used:
            if self.stages[sid].client.is_dead:
                raise self.stages[sid].client.dead_error
        state = ClientRequestState(
            request_id, prompt, self._params_per_stage(params_by_stage), plan.finals,
            {sid: StageTrack(sources_pending=len(plan.sources[sid]), consumers_pending=plan.consumers[sid])
             for sid in used},
            (metrics or self.metrics).new_request(request_id), metrics or self.metrics,
            execution_mode=execution_mode or self.execution_mode,
        )
        for sid in used:
            if plan.sources[sid]:
                state.processors[sid] = self.graph.edge_inputs(sid, plan.sources[sid], prompt)
        speaking = [sid for sid in plan.finals if self.stages[sid].final_output_type == "audio"]
        if speaking:
            state.playback = PlaybackClock(deadline if deadline is not None else time.time(),
                                           speed_of(state.params.get(speaking[0])))
            for inputs in state.processors.values():
                inputs.follow_playback(state.playback)
        else:
            state.deadline = deadline
        if self.tracer is not None:
            state.trace = self.tracer.start_request(request_id, trace_headers)
        if lora_requests:
            state.lora_requests = dict(lora_requests)
        self._requests[request_id] = state
        self._idle.clear()
        self.start()
        try:
            for sid in used:
                if state.stages[sid].sources_pending == 0:
                    await self._submit_sub_request(state, sid, StageInput(prompt))
        except BaseException as exc:
            await self.endings.abort_everywhere(state)
            self.endings.finish(state, exc)
            raise
        return state

    def _plan(self, entry: int | None, final_stage_id: int | Sequence[int] | None) -> RequestPlan:
        """The graph's plan for this shape of request, from the cache after the first."""
        key = (entry, final_stage_id if final_stage_id is None or isinstance(final_stage_id, int)
               else tuple(final_stage_id))
        plan = self._plans.get(key)
        if plan is None:
            plan = self.graph.plan(entry, final_stage_id)  # ValueError: not cached
            if len(self._plans) < MAX_CACHED_PLANS:
                self._plans[key] = plan
        return plan

    def _params_per_stage(self, params_by_stage: Mapping[int, Any] | None) -> dict[int, Any]:
        given = dict(params_by_stage or {})
        unknown = sorted(set(given) - set(self.stages), key=str)
        if unknown:
            raise ValueError(f"sampling params for stage(s) {unknown}, which are not in the pipeline "
                             f"(stages {self.stage_order})")
        return {sid: given[sid] if given.get(sid) is not None else self.stages[sid].default_sampling_params or None
                for sid in self.stage_order}

    async def _submit_sub_request(self, state: ClientRequestState, sid: int, inp: StageInput) -> int:
        if state.ended or state.aborting:
            # Aborted (perhaps while an earlier submit of its routing step was
            # awaited): nothing more may reach a stage, or it would run for nobody.
            return 0
        track = state.stages[sid]
        k = track.submitted
        track.submitted += 1
        sub_id = state.request_id if k == 0 else f"{state.request_id}#{k}"
        params = inp.sampling_params if inp.sampling_params is not None else state.params[sid]
        track.inflight[sub_id] = k
        track.kinds[sub_id] = _output_kind(params)
        track.sub_ids.append(sub_id)
        self._routes[sid][sub_id] = state
        self.events.submitting(state, sid, k)
        if inp.opens_stream:
            track.open_stream = track.streamed = sub_id
        client = self.stages[sid].client
        sent_before = client.bytes_sent
        trace = state.trace
        await client.submit_request(sub_id, inp.prompt, params, end_on_finish=False, group=state.request_id,
                                    trace=trace.submitting(sid) if trace is not None else None,
                                    deadline=state.deadline_of(k, inp.prompt), input_stream=inp.opens_stream,
                                    stream_states=self._streams_states(state, sid),
                                    lora_request=state.lora_requests.get(sid))
        nbytes = client.bytes_sent - sent_before
        self.events.submitted(state, sid, nbytes)
        if trace is not None:
            replica_of = getattr(client, "replica_of", None)
            trace.submitted(sid, replica_of(sub_id) if replica_of is not None else None)
        return nbytes

    def _streams_states(self, state: ClientRequestState, sid: int) -> bool:
        """Whether a consumer of ``sid`` starts on its first states (its edge async_chunk, its input
        processor ``starts_on_states``): then ``sid``'s partial outputs carry them."""
        return any(self.edge_mode(sid, dst, state) == "async_chunk"
                   and getattr(state.processors[dst].for_source(sid), "starts_on_states", False)
                   for dst in self.consumers[sid] if dst in state.processors)

    async def _extend_sub_request(self, state: ClientRequestState, sid: int, inp: StageInput) -> int:
        """Append ``inp`` to the input of ``sid``'s open sub-request; dropped where that has ended
        (a talker that spoke its stop code before its thinker finished) or the request is ending."""
        track = state.stages[sid]
        sub_id = track.open_stream
        if inp.last:
            track.open_stream = None
        if sub_id is None or sub_id not in track.inflight or state.ended or state.aborting:
            return 0
        client = self.stages[sid].client
        sent_before = client.bytes_sent
        await client.extend_request(sub_id, inp.prompt, last=inp.last)
        return client.bytes_sent - sent_before

    async def _forward_to_next_stage(self, state: ClientRequestState, dst: int, inputs: list[StageInput],
                                     src_times: dict[int, float] | None = None) -> None:
        """Submit ``inputs`` to ``dst``; ``src_times``: when each source produced what they were built from."""
        for inp in inputs:
            submit = self._extend_sub_request if inp.continues else self._submit_sub_request
            self.events.forwarded(dst, await submit(state, dst, inp), src_times)

    # -------------------------------------------------------------- outputs
    async def _read_stage(self, ctx: StageContext) -> None:
        # No batch is kept in this frame across the await: a cancelled task
        # keeps its frame (via the stored CancelledError), and a batch held
        # there would pin its outputs' shared-memory slots.
        client = ctx.client
        while self._requests:
            try:
                received_before = client.bytes_received
                await self._route_batch(ctx.stage_id, await client.get_outputs_async())
            except StageDeadError as exc:
                await self.endings.fail_stage(ctx.stage_id, exc)
                return
            finally:
                self.metrics.stage(ctx.stage_id).bytes_out += client.bytes_received - received_before

    async def _route_batch(self, sid: int, items: list[Any]) -> None:
        for item in items:
            state = self._routes[sid].get(item.request_id)
            if state is None:
                continue  # aborted or finished meanwhile
            try:
                if isinstance(item, (StageRequestError, StageDeadError)):  # (lost with a replica)
                    await self.endings.fail(state, item)
                elif self._has_async_edge(sid, state):
                    await self._process_async_chunk_pipeline(state, sid, item)
                else:
                    await self._process_sequential_pipeline(state, sid, item)
            except StageDeadError as exc:  # a stage it was forwarded to is gone
                await self.endings.fail(state, exc)
            except Exception as exc:  # noqa: BLE001 - e.g. an input processor failed
                logger.exception("request %s failed while routing stage %d output", state.request_id, sid)
                await self.endings.fail(state, StageRequestError(
                    sid, state.request_id,
                    f"routing the output of stage {sid} for request {state.request_id!r} failed: "
                    f"{type(exc).__name__}: {exc}", type(exc).__name__))

    def _has_async_edge(self, sid: int, state: ClientRequestState) -> bool:
        return any(self.edge_mode(sid, d, state) == "async_chunk" for d in self.consumers[sid])

    async def _process_sequential_pipeline(self, state: ClientRequestState, sid: int, output: OmniRequestOutput) -> None:
        """Route one output: downstream stages start only when this one is done."""
        await self._route(state, sid, output, forward_chunks=False)

    async def _process_async_chunk_pipeline(self, state: ClientRequestState, sid: int, output: OmniRequestOutput) -> None:
        """Route one output: every chunk the edge's processor accepts goes on at once."""
        await self._route(state, sid, output, forward_chunks=True)

    async def _route(self, state: ClientRequestState, sid: int, output: OmniRequestOutput, forward_chunks: bool) -> None:
        track = state.stages[sid]
        sub_id = output.request_id
        k = track.inflight[sub_id]
        now = asyncio.get_running_loop().time()
        self.events.output(state, sid, k, now, output.finished)
        if state.trace is not None:
            state.trace.output(sid, sub_id, output, track.kinds.get(sub_id) is RequestOutputKind.DELTA)
        new_text = new_text_of(track, sub_id, output)
        track.text += new_text
        versions = getattr(output, "stage_versions", None)
        if versions:
            state.add_versions(versions)
        if output.outputs and sid in state.final_stages and track.kinds.get(sub_id) is not RequestOutputKind.DELTA:
            track.last_output = output  # the partial answer, should an abort have to be ended here
        if track.consumers_pending:
            track.outputs.append(output)
        if output.finished:
            del track.inflight[sub_id]
            del self._routes[sid][sub_id]
            track.kinds.pop(sub_id, None)
        if forward_chunks:
            for dst in self.consumers[sid]:
                if dst in state.stages and self.edge_mode(sid, dst, state) == "async_chunk":
                    processor = state.processors[dst].for_source(sid)
                    await self._forward_to_next_stage(state, dst, processor.on_output(output, new_text), {sid: now})
            if state.ended:  # aborted while forwarding
                return
        if sid in state.final_stages:
            if output.finished and sub_id == track.streamed and not track.complete:
                # its input in parts ended early (a talker's stop code before its thinker's end):
                # its final output goes to the caller when the stage is done, as its last
                track.held_final = (k, output)
            else:
                self._emit(state, sid, k, output)
        if track.complete and not track.done:
            await self._stage_done(state, sid)

    def _emit(self, state: ClientRequestState, sid: int, k: int, output: OmniRequestOutput) -> None:
        """Deliver to the caller in sub-request order; ``finished`` only on the stage's last."""
        track = state.stages[sid]
        if k != track.next_emit:
            track.held.setdefault(k, []).append(output)
            return
        chunk: list[OmniRequestOutput] | None = [output]
        clock = state.playback
        while chunk:
            finished = chunk[-1].finished
            for out in chunk:
                if clock is not None and (seconds := audio_seconds(out)):
                    clock.heard(track.next_emit, seconds, time.time())
                self._deliver(state, sid, out)
            if not finished:
                return
            track.next_emit += 1
            chunk = track.held.pop(track.next_emit, None)

    def _deliver(self, state: ClientRequestState, sid: int, output: OmniRequestOutput) -> None:
        track = state.stages[sid]
        output.request_id = state.request_id
        if state.stage_versions:
            output.stage_versions = {s: list(v) for s, v in state.stage_versions.items()}
        output.finished = output.finished and track.complete and not track.held
        track.closed = output.finished
        state.queue.put_nowait(output)
        if state.queue.qsize() > self.max_undelivered_outputs and not state.overflowed:
            # The caller stopped reading: end the request rather than hold its outputs without bound.
            state.overflowed = True
            asyncio.get_running_loop().create_task(self.endings.fail(state, PipelineOverloadedError(
                f"request {state.request_id!r} aborted: its caller left {state.queue.qsize()} outputs unread "
                f"(runtime.max_undelivered_outputs is {self.max_undelivered_outputs})", state.request_id)))

    async def _stage_done(self, state: ClientRequestState, sid: int) -> None:
        """``sid`` has nothing more for this request: feed its consumers, close it."""
        track = state.stages[sid]
        track.done = True
        state.metrics.stage_done[sid] = asyncio.get_running_loop().time()
        if state.trace is not None:
            state.trace.stage_done(sid, aborted=state.aborting)
        if track.held_final is not None:
            k, output = track.held_final
            track.held_final = None
            self._emit(state, sid, k, output)
        if sid in state.final_stages and not track.closed and not (state.aborting and not track.submitted):
            ctx = self.stages[sid]
            self._deliver(state, sid, OmniRequestOutput(
                state.request_id, finished=True, stage_id=sid, final_output_type=ctx.final_output_type))
        for dst in self.consumers[sid]:
            if dst not in state.stages:
                continue
            dst_track = state.stages[dst]
            dst_track.sources_pending -= 1
            if dst_track.sources_pending == 0:
                srcs = [s for s in self.sources[dst] if s in state.stages]
                inputs = state.processors[dst].on_finish(
                    {s: state.stages[s].outputs for s in srcs}, {s: state.stages[s].text for s in srcs})
                for s in srcs:
                    src_track = state.stages[s]
                    src_track.consumers_pending -= 1
                    if src_track.consumers_pending == 0:
                        src_track.outputs = []  # every consumer has what it needs
                await self._forward_to_next_stage(state, dst, inputs, {
                    s: state.metrics.stage_done.get(s, asyncio.get_running_loop().time()) for s in srcs})
                if state.ended:  # aborted while forwarding
                    return
                if dst_track.complete and not dst_track.done:
                    await self._stage_done(state, dst)
        if all(state.stages[f].done for f in state.final_stages):
            self.endings.finish(state)

    # ------------------------------------------------------------ streaming
    def process_pipeline(
        self,
        request_id: str,
        prompt: Any,
        sampling_params_list: Sequence[Any] | None = None,
        metrics: OrchestratorMetrics | None = None,
        final_stage_id: int | Sequence[int] | None = None,
        execution_mode: str | None = None,
        entry_stage_id: int | None = None,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """The seed's entry: ``sampling_params_list`` in stage order (None entries: the stage's defaults)."""
        return self.stream_request(request_id, prompt, self.graph.params_by_stage(sampling_params_list), metrics,
                                   final_stage_id, execution_mode, entry_stage_id)

    async def stream_request(
        self,
        request_id: str,
        prompt: Any,
        params_by_stage: Mapping[int, Any] | None = None,
        metrics: OrchestratorMetrics | None = None,
        final_stage_id: int | Sequence[int] | None = None,
        execution_mode: str | None = None,
        entry_stage_id: int | None = None,
        trace_headers: Mapping[str, str] | None = None,
        deadline: float | None = None,
        lora_requests: Mapping[int, Any] | None = None,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """Submit and stream the request's final outputs; leaving early aborts it."""
        state = await self.submit_request(request_id, prompt, params_by_stage, final_stage_id, metrics,
                                          execution_mode, entry_stage_id, trace_headers, deadline, lora_requests)
        try:
            while True:
                item = await state.queue.get()
                if item is ClientRequestState.END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if request_id in self._requests and self._requests[request_id] is state:
                await self.endings.abort_everywhere(state)
                self.endings.finish(state, RequestAbortedError(f"request {request_id!r} was abandoned"))


def _output_kind(params: Any) -> RequestOutputKind:
    """How a text stage reports text for these params (decides how new text is found)."""
    if isinstance(params, SamplingParams):
        return params.output_kind
    if isinstance(params, dict) and "output_kind" in params:
        return parse_output_kind(params["output_kind"])
    return RequestOutputKind.CUMULATIVE


__all__ = ["ABORT_WAIT_S", "PipelineOrchestrator", "RequestAbortedError"]
