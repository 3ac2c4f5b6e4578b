"""``MultiStageEngineClient``: a whole pipeline behind vLLM's ``EngineClient`` protocol.

Wherever vLLM expects an engine client (its OpenAI server, benchmarks,
user code written against ``AsyncLLM``), a pipeline of stage processes can
stand in. Generation goes through the ``PipelineOrchestrator``; control calls
(pause, sleep, collective_rpc, weight updates, ...) fan out to the stages that support them
(``stage_control.StageControl``, mixed in).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest

from omni_engine.config import EdgeConfig, PipelineConfig, WeightsConfig, load_pipeline_config
from omni_engine.entrypoints.mm_wire import wire_multimodal_input
from omni_engine.entrypoints.openai.engine_config import TextStageConfig, start_with_text_stage, text_stage_of
from omni_engine.entrypoints.openai.served_defaults import fill_client_defaults
from omni_engine.entrypoints.openai.weight_versions import RESPONSE_VERSIONS
from omni_engine.entrypoints.stage_control import StageControl
from omni_engine.errors import StageDeadError, StageRequestError
from omni_engine.loop_context import LoopContext, loop_context, running_loop
from omni_engine.metrics import OrchestratorMetrics, PipelineObserver
from omni_engine.outputs import OmniRequestOutput
from omni_engine.pipeline.lora import lora_requests_by_stage
from omni_engine.pipeline.orchestrator import PipelineOrchestrator
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.pipeline.stage_clients import Placement, Progress, StageClientFactory, start_pipeline
from omni_engine.pipeline.stage_specs import prepare_models
from omni_engine.pipeline.stage_supervisor import RestartableStage, StageSupervisor
from omni_engine.pipeline.weight_sync import WeightSync, WeightUpdateError
from omni_engine.stage_engine.stage_client import ReplicaStatus
from omni_engine.tracing.context import REQUEST_TRACE_HEADERS

logger = logging.getLogger(__name__)

# Seconds a synchronous shutdown() takes at most by default (then the stages are killed).
SHUTDOWN_TIMEOUT_S = 30.0
# Errors a stage reports for a request that vLLM treats as the client's fault (HTTP 400).
_VALIDATION_ERROR_TYPES = frozenset({"VLLMValidationError", "ValueError", "TypeError", "OverflowError"})


def engine_core_request_to_prompt(request: EngineCoreRequest) -> tuple[dict[str, Any], Any]:
    """A ``TokensInput`` dict and the sampling params of an ``EngineCoreRequest`` (deprecated in vLLM's
    serving code, which now renders an ``EngineInput`` dict itself: that crosses to the text stage as is)."""
    if request.prompt_token_ids is None:
        raise VLLMValidationError("an EngineCoreRequest without prompt_token_ids (embeddings) cannot be served")
    if request.mm_features:
        raise VLLMValidationError("multimodal EngineCoreRequests are not supported by omni_engine pipelines yet")
    prompt: dict[str, Any] = {"type": "token", "prompt_token_ids": list(request.prompt_token_ids)}
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt, request.sampling_params


class MultiStageEngineClient(StageControl, EngineClient):
    """A pipeline of stages that vLLM can serve as one model."""

    def __init__(
        self,
        stages: Sequence[StageContext],
        execution_mode: str = "sequential",
        edges: Sequence[EdgeConfig] | None = None,
        config: PipelineConfig | None = None,
        restartable: Mapping[int, RestartableStage] | None = None,
        placement: Placement | None = None,
        text_stage: TextStageConfig | None = None,
    ) -> None:
        """``edges``: per-edge overrides (default: the config's ``runtime.edges``).
        ``restartable``: the stages whose dead replicas are started again
        (``runtime.restart: on-failure``), each with how to make a replica.
        ``placement`` (Ray's) is closed after the stages stop. ``text_stage``: the
        text stage's vLLM objects, which vLLM's serving layer reads from its engine client."""
        self.stage_contexts = list(stages)
        self.config = config
        self.placement = placement
        self.metrics = OrchestratorMetrics()
        limits = {}
        if config is not None:
            limits = dict(max_inflight_requests=config.runtime.max_inflight_requests,
                          max_undelivered_outputs=config.runtime.max_undelivered_outputs)
        if edges is None:
            edges = config.runtime.edges if config is not None else ()
        self.orchestrator = PipelineOrchestrator(stages, execution_mode, edges, self.metrics, **limits)
        # Spans of every request, exported to runtime.otlp_traces_endpoint; None: not traced.
        self.tracer = self._make_tracer(config)
        self.orchestrator.tracer = self.tracer
        weights = config.weights if config is not None else WeightsConfig()
        weight_stages = (config.weight_stage_ids() if config is not None
                         else [ctx.stage_id for ctx in self.stage_contexts if ctx.stage_type in (None, "llm")])
        self.weights = WeightSync([ctx for ctx in self.stage_contexts if ctx.stage_id in weight_stages], weights,
                                  self.resume_generation)
        self.supervisor = StageSupervisor(restartable or {}, prepare_replica=self.weights.prepare_replica)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._stopped = False
        self._closed = False  # every stage stopped and freed (_stopped: shutting down)
        # The loop that owns the stage sockets and tasks (a synchronous shutdown needs it).
        self._loop: asyncio.AbstractEventLoop | None = running_loop()
        # What vLLM's serving layer reads (None without a text stage config).
        self.text_stage_id: int | None = text_stage.stage_id if text_stage is not None else None
        self.vllm_config: Any = text_stage.vllm_config if text_stage is not None else None
        self.model_config: Any = text_stage.model_config if text_stage is not None else None
        self.renderer: Any = text_stage.renderer if text_stage is not None else None
        self.input_processor: Any = text_stage.input_processor if text_stage is not None else None
        self.supervisor.launch_spares()  # last: the pipeline is up, nothing after this can fail

    def _make_tracer(self, config: PipelineConfig | None) -> Any:
        """A ``PipelineTracer`` when the config names an OTLP endpoint (OpenTelemetry imported only then)."""
        endpoint = config.runtime.otlp_traces_endpoint if config is not None else None
        if not endpoint:
            return None
        from omni_engine.tracing.exporter import make_tracer_provider
        from omni_engine.tracing.request_trace import PipelineTracer

        names = {ctx.stage_id: (ctx.name, ctx.stage_type or "") for ctx in self.stage_contexts}
        return PipelineTracer(make_tracer_provider(endpoint), names)

    # ------------------------------------------------------------ building
    @classmethod
    async def from_config(
        cls, config: PipelineConfig | str | Path, *, progress: Progress | None = None,
        make_stage_client: StageClientFactory | None = None, text_stage: bool = False,
        launched: dict[int, Any] | None = None,
    ) -> "MultiStageEngineClient":
        """Validate the config, prepare its models, start every stage process (in parallel), and connect.

        ``make_stage_client(stage_config, process_spec)`` builds the client of
        one stage; the default is a ZMQ ``StageEngineCoreClient`` (the legacy
        architecture passes its ``multiprocessing.Queue`` one). With ``text_stage``
        the text stage's vLLM objects (config, renderer, input processor: what
        vLLM's serving layer reads) load while the stages start (no engine here).
        ``launched``: stage processes already started from this config
        (``pipeline.early_launch``), which their clients adopt.
        """
        cfg = config if isinstance(config, PipelineConfig) else load_pipeline_config(config)
        say = progress or (lambda msg: None)
        cfg = prepare_models(cfg, say)
        text_stage_config = text_stage_of(cfg) if text_stage else None  # ValueError (no llm stage) first
        pipeline, text = await start_with_text_stage(start_pipeline(cfg, say, make_stage_client, launched),
                                                     text_stage_config)
        return cls(pipeline.stages, cfg.runtime.execution_mode, cfg.runtime.edges, cfg,
                   pipeline.restartable, pipeline.placement, text)

    async def __aenter__(self) -> "MultiStageEngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown_async()

    # ---------------------------------------------------------- generation
    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        final_stage_id: int | Sequence[int] | None = None,
        execution_mode: str | None = None,
        entry_stage_id: int | None = None,
        modalities: Sequence[str] | None = None,
        lora_request: Any = None,
        deadline: float | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """Stream the pipeline's final outputs for one request.

        ``sampling_params`` is one stage's params (a ``SamplingParams`` or its
        dict form) for the entry stage (the first stage, ``entry_stage_id``, or
        the text stage when the client has one), a list in stage order (the
        seed's ``sampling_params_list``), or a mapping of stage id (int) to
        params; stages without params use their ``default_sampling_params``.
        ``entry_stage_id`` starts the request at that stage (its sources are not
        run; ``prompt`` is its input). Leaving the generator early aborts the
        request on every stage. A dead stage fails only the requests that need
        it (the orchestrator checks the stages a request uses).

        ``sampling_params_list=[...]`` (vLLM-Omni's ``AsyncOmni`` keyword) is that list, given by
        name; with ``sampling_params`` too it is refused.

        ``lora_request`` (vLLM's ``LoRARequest``) runs the entry (or text) stage with that adapter; a
        mapping ``{stage_id: LoRARequest}`` names the stage of each. A stage must set
        ``engine_args.enable_lora``, else the request is refused naming it (``pipeline.lora``).

        ``deadline`` (``time.time()`` seconds) is when the first output is needed; every stage
        serves earliest deadline first, and a request that ends in speech gets one per piece of
        speech from it (or from now): when the listener, playing at 1x, would run dry.

        ``trace_headers`` (vLLM's keyword; else those of the HTTP request being served) is the
        caller's W3C trace context, which the request's spans continue when the pipeline traces
        (``runtime.otlp_traces_endpoint``).

        With a text stage (what vLLM's OpenAI server calls; its other extra keywords,
        ``priority``, ... are accepted and unused), a request
        is checked by vLLM's own input processor first (HTTP 400), ends at the
        text stage unless ``modalities`` asks for more, and a stage's
        validation error becomes vLLM's; params that name no stop string get the
        text stage's default ``stop`` (vLLM's handlers fill the other defaults:
        ``served_defaults``).
        """
        if "sampling_params_list" in kwargs:  # vLLM-Omni's keyword: taken, never left among the unused ones
            sampling_params = per_stage_params(sampling_params, kwargs.pop("sampling_params_list"))
        if isinstance(prompt, EngineCoreRequest):
            prompt, sampling_params = engine_core_request_to_prompt(prompt)
        self._check_running(any_stage_dead=False)
        if self.text_stage_id is not None:
            if isinstance(sampling_params, SamplingParams):  # one request of vLLM's routes
                sampling_params = fill_client_defaults(sampling_params, self.stage_default_params(self.text_stage_id))
            self.validate_request(prompt, sampling_params, request_id)
            if final_stage_id is None and entry_stage_id is None:
                final_stage_id = self.final_stages_for(modalities)
        if isinstance(prompt, dict) and prompt.get("type") == "multimodal":  # (no call on a text request's path)
            prompt = wire_multimodal_input(prompt, request_id)
        if not self._resumed.is_set():
            await self._resumed.wait()
        entry = entry_stage_id if entry_stage_id is not None else self.text_stage_id
        params = self.sampling_params_by_stage(sampling_params, entry)
        loras = None
        if lora_request is not None:
            try:
                default = entry if entry is not None else self.orchestrator.stage_order[0]
                loras = lora_requests_by_stage(lora_request, default, self.lora_stage_ids, request_id)
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="model") from None
        trace_headers = kwargs.get("trace_headers") or REQUEST_TRACE_HEADERS.get() if self.tracer else None
        stream = self.orchestrator.stream_request(
            request_id, prompt, params, self.metrics, final_stage_id, execution_mode, entry_stage_id, trace_headers,
            deadline, loras)
        versions = RESPONSE_VERSIONS.get()  # an HTTP response's weight-version header (None elsewhere)
        try:
            async for output in stream:
                if versions is not None and output.stage_versions:
                    versions.update(output.stage_versions)
                yield output
        except StageRequestError as exc:
            if self.text_stage_id is not None and exc.error_type in _VALIDATION_ERROR_TYPES:
                raise VLLMValidationError(exc.message) from exc
            raise
        finally:
            # A caller that leaves (aclose, cancellation) aborts the request
            # now, not whenever the inner generator is garbage-collected.
            await stream.aclose()

    def final_stages_for(self, modalities: Sequence[str] | None) -> int | None:
        """The stage a request of the OpenAI server ends at: the text stage for text only (the
        default), else None (the pipeline's finals)."""
        if self.text_stage_id is not None and set(modalities or ("text",)) <= {"text"}:
            return self.text_stage_id
        return None

    def validate_request(self, prompt: Any, sampling_params: Any, request_id: str) -> None:
        """Reject a bad request here with vLLM's own checks (HTTP 400), before any stage sees it.

        Only for rendered inputs (cheap: no tokenizing); the stage repeats the
        checks anyway.
        """
        if self.input_processor is None or not isinstance(sampling_params, SamplingParams):
            return
        if isinstance(prompt, dict) and "type" in prompt:
            self.input_processor.process_inputs(request_id, prompt, sampling_params, supported_tasks=("generate",))

    def sampling_params_by_stage(self, sampling_params: Any, for_stage: int | None = None) -> dict[int, Any]:
        """Sampling params keyed by stage id, as the pipeline takes them (the one conversion).

        A mapping keyed by ints is already by stage; a mapping with str keys is
        one stage's params in dict form (``{"max_tokens": 8}``), like a ``SamplingParams``:
        one stage's params are for ``for_stage`` (default: the first stage).
        """
        if isinstance(sampling_params, Mapping) and all(type(k) is int for k in sampling_params):
            return dict(sampling_params)
        if isinstance(sampling_params, (list, tuple)):
            return self.orchestrator.graph.params_by_stage(sampling_params)
        if sampling_params is None:
            return {}
        return {for_stage if for_stage is not None else self.orchestrator.stage_order[0]: sampling_params}

    async def abort(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self.orchestrator.abort_request(ids)

    def in_flight_request_ids(self) -> list[str]:
        """The requests in the pipeline now (for "abort everything")."""
        return self.orchestrator.request_ids()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("omni_engine pipelines generate; pooling (encode) is not supported")

    # -------------------------------------------------------------- status
    def _check_running(self, *, any_stage_dead: bool = True) -> None:
        if self._stopped:
            raise RuntimeError("MultiStageEngineClient is shut down")
        error = self.dead_error
        if any_stage_dead and error is not None:
            raise error

    # ------------------------------------------------------- inspection
    def stage_ids(self) -> list[int]:
        """The pipeline's stages, in config order."""
        return list(self.orchestrator.stage_order)

    def stage_edges(self) -> list[tuple[int, int]]:
        """Every (source, destination) edge of the stage graph."""
        return [(src, dst) for dst in self.orchestrator.stage_order for src in self.orchestrator.sources[dst]]

    def final_stage_ids(self) -> list[int]:
        """The stages whose outputs reach the caller by default."""
        return self.orchestrator.final_stage_ids() or self.orchestrator.stage_order[-1:]

    def stage_for_output(self, output_type: str) -> int | None:
        """The first final stage producing ``output_type`` (e.g. the speech stage for "audio")."""
        for ctx in self.stage_contexts:
            if ctx.is_final_output and ctx.final_output_type == output_type:
                return ctx.stage_id
        return None

    def text_entry_stage(self, stage_id: int) -> int:
        """Where text goes in to reach ``stage_id`` without the LLM: up its single-source chain of
        non-LLM stages (the speech stage itself for eSpeak; the phonemizer before a Piper voice)."""
        types = {ctx.stage_id: ctx.stage_type for ctx in self.stage_contexts}
        entry = stage_id
        while len(sources := self.orchestrator.sources[entry]) == 1 and types[sources[0]] not in (None, "llm"):
            entry = sources[0]
        return entry

    def stage_info(self, stage_id: int) -> dict[str, Any]:
        """What the stage's engine said about itself when it became ready (``{}`` before that)."""
        ready = self.orchestrator.stages[stage_id].client.ready
        return dict(ready.engine_info) if ready is not None else {}

    def stage_default_params(self, stage_id: int) -> dict[str, Any]:
        """The stage's ``default_sampling_params`` from its config, as a dict (``{}`` when none)."""
        params = self.orchestrator.stages[stage_id].default_sampling_params
        if params is None:
            return {}
        return dict(params) if isinstance(params, dict) else {
            name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "max_tokens")
            if hasattr(params, name)}

    def stage_alive(self, stage_id: int) -> bool:
        """Whether the stage serves: one of its replicas is up (False once none is, until a restart)."""
        return not self.orchestrator.stages[stage_id].client.is_dead

    def replica_status(self, stage_id: int) -> list[ReplicaStatus]:
        """Per replica of the stage: alive, requests in flight, requests sent to it, pid, host."""
        return self.orchestrator.stages[stage_id].client.replica_status()

    def replica_alive(self, stage_id: int, replica: int) -> bool:
        status = self.replica_status(stage_id)
        return replica < len(status) and status[replica].alive

    def stage_retries(self) -> dict[int, int]:
        """Per stage: requests moved to another replica when theirs died (``runtime.retry``)."""
        return {ctx.stage_id: ctx.client.resubmitted for ctx in self.stage_contexts}

    def stage_load(self) -> dict[int, tuple[int, int]]:
        """Per stage: (waiting, running) sub-requests."""
        return self.orchestrator.stage_load()

    def stage_restarts(self) -> dict[int, int]:
        """Per stage: how often it was restarted after dying (``runtime.restart``)."""
        restarts = self.supervisor.restarts
        return {ctx.stage_id: restarts.get(ctx.stage_id, 0) for ctx in self.stage_contexts}

    def state_counts(self) -> dict[str, int]:
        """What the pipeline holds for requests, summed over the orchestrator and every
        stage client: all zero once it is idle (``in_flight``, ``held``, ``queued`` of the
        stage clients; ``requests``, ``routes``, ``readers`` of the orchestrator)."""
        counts = dict(self.orchestrator.state_counts())
        for ctx in self.stage_contexts:
            for key, value in ctx.client.state_counts().items():
                counts[key] = counts.get(key, 0) + value
        return counts

    @property
    def observer(self) -> PipelineObserver | None:
        """Told of every request event as it happens (e.g. the Prometheus exporter)."""
        return self.orchestrator.observer

    @observer.setter
    def observer(self, observer: PipelineObserver | None) -> None:
        self.orchestrator.observer = observer

    @property
    def is_running(self) -> bool:
        return not self._stopped and not self.errored

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return any(ctx.client.is_dead for ctx in self.stage_contexts) and not self._stopped

    @property
    def dead_error(self) -> BaseException:
        for ctx in self.stage_contexts:
            if ctx.client.dead_error is not None and not self._stopped:
                return ctx.client.dead_error
        return None  # type: ignore[return-value]

    async def check_health(self) -> None:
        """Raise ``StageDeadError`` (a vLLM ``EngineDeadError``) naming the first failing stage."""
        self._check_running()
        await asyncio.gather(*(ctx.client.check_health() for ctx in self.stage_contexts))

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def is_tracing_enabled(self) -> bool:
        return self.tracer is not None

    async def do_log_stats(self) -> None:
        for sid, m in sorted(self.metrics.stages.items()):
            logger.info(
                "stage %d: %d requests (%d finished, %d failed, %d aborted), mean queue %.3f s, mean run %.3f s, "
                "%d B in, %d B out", sid, m.requests, m.finished, m.failed, m.aborted, m.mean_queue_time_s,
                m.mean_run_time_s, m.bytes_in, m.bytes_out)

    # ------------------------------------------------------------ shutdown
    async def shutdown_async(self) -> None:
        """Stop routing, then every stage process; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.supervisor.stop()
        await self.weights.close()
        await self.orchestrator.stop()
        await asyncio.gather(*(ctx.client.shutdown() for ctx in self.stage_contexts), return_exceptions=True)
        self._close_placement()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)
        self._closed = True

    def _close_placement(self) -> None:
        if self.placement is not None:
            self.placement.close()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every stage and free everything, synchronously (as vLLM's ``AsyncLLM.shutdown``).

        Idempotent and bounded in time (``timeout``, default ``SHUTDOWN_TIMEOUT_S``,
        then the stages are killed), from any context: from another thread
        while the client's loop runs, the work runs on that loop and this
        thread waits; on the loop's own thread (a coroutine, a signal handler)
        or once the loop stopped or closed, it is done here without awaiting:
        SHUTDOWN is sent, the processes get a grace period, then SIGTERM and
        SIGKILL; sockets, socket files and shared memory are freed; tasks are
        cancelled (none is left to warn when collected).
        """
        if self._closed:
            return
        limit = timeout if timeout else SHUTDOWN_TIMEOUT_S
        if loop_context(self._loop) is LoopContext.OTHER_THREAD:
            future = asyncio.run_coroutine_threadsafe(self.shutdown_async(), self._loop)
            try:
                future.result(limit)
                return
            except Exception as exc:  # noqa: BLE001 - stopped the hard way below
                logger.warning("shutdown on the client's loop did not complete (%r); stopping the stages here", exc)
                future.cancel()
        self._shutdown_now(limit)

    def _shutdown_now(self, timeout: float) -> None:
        self._stopped = True
        self.supervisor.stop_now()
        self.weights.close_now()
        self.orchestrator.stop_now()
        # Every stage is asked first, so they wind down together within one grace period.
        asked = [ctx for ctx in self.stage_contexts if ctx.client.ask_stop_now()]
        deadline = time.monotonic() + timeout / 2
        for ctx in asked:
            try:
                ctx.client.finish_shutdown_now(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the other stages are stopped regardless
                logger.exception("stage %d: shutdown failed", ctx.stage_id)
        self._close_placement()
        if self.tracer is not None:
            self.tracer.shutdown()
        self._closed = True


def per_stage_params(sampling_params: Any, sampling_params_list: Sequence[Any] | None) -> Any:
    """``generate``'s params where the caller named ``sampling_params_list``: that list (a keyword
    this client would otherwise accept unused, as it does vLLM's server's extras)."""
    if sampling_params is not None:
        raise TypeError("generate() got both sampling_params and sampling_params_list: give the per-stage "
                        "list alone (one entry per stage, in stage order; None for a stage's defaults)")
    return None if sampling_params_list is None else list(sampling_params_list)


__all__ = ["MultiStageEngineClient", "StageDeadError", "WeightUpdateError"]

