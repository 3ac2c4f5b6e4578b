"""The control half of ``MultiStageEngineClient``: vLLM's ``EngineClient`` calls that fan out to stages.

Pause and resume, the weight-update protocol (through ``WeightSync``), ``collective_rpc``, sleep,
cache resets, profiling, LoRA adapters and engine metrics: each picks the stages it concerns (every
llm stage unless told; a mixing theta stage left alone where its teachers decide for it) and calls
them, every replica of each, at once. Generation and the client's lifecycle stay in
``multi_stage_engine_client``; this mixin reads what that client builds (``stage_contexts``,
``orchestrator``, ``weights`` and its resume event).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from omni_engine.pipeline.lora import lora_stage_ids
from omni_engine.pipeline.weight_sync import check_version_order

if TYPE_CHECKING:
    from omni_engine.pipeline.orchestrator import PipelineOrchestrator
    from omni_engine.pipeline.stage_context import StageContext
    from omni_engine.pipeline.weight_sync import WeightSync


class StageControl:
    """vLLM's control calls over the stages, mixed into ``MultiStageEngineClient``."""

    stage_contexts: list[StageContext]
    orchestrator: PipelineOrchestrator
    weights: WeightSync
    _resumed: asyncio.Event  # set while generation runs; new requests wait on it

    # ------------------------------------------------------- pause, resume
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop taking new requests on every stage.

        ``abort`` aborts what is in flight, ``wait`` lets it finish first,
        ``keep`` freezes it in the LLM stages until ``resume_generation``.
        A mixing theta stage is not paused itself: it runs only inside its teachers' steps, so
        it is idle once they are paused. Paused on its own, under ``keep`` it refused to clear
        its cache (its per-request sessions hold KV), and its scorer's per-batch resume would
        undo the pause anyway.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self._resumed.clear()
        if mode == "abort":
            await self.orchestrator.abort_request(list(self.orchestrator.request_ids()))
        elif mode == "wait":
            await self.orchestrator.wait_idle()
        await self._call_stages("pause_generation", llm_only=True, theta=False, mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self._call_stages("resume_generation", llm_only=True, theta=False)
        self._resumed.set()

    async def is_paused(self) -> bool:
        """Paused here (new requests wait), or any llm stage says its engine is paused."""
        if not self._resumed.is_set():
            return True
        return any(await self._call_stages("is_paused", llm_only=True, theta=False))

    # ------------------------------------------------------ weight updates
    # vLLM's EngineClient weight protocol, over every replica of the stages ``weights.stages``
    # names (default: every llm stage); see ``WeightSync`` for what it adds.
    async def init_weight_transfer_engine(self, init_request: Any) -> None:
        await self.weights.init_weight_transfer_engine(_payload(init_request, "init_info"))

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.weights.shutdown_weight_transfer_engine()

    async def start_weight_update(self) -> None:
        await self.weights.start_weight_update()

    async def start_draft_weight_update(self) -> None:
        await self.weights.start_weight_update(draft=True)

    async def update_weights(self, request: Any) -> None:
        await self.weights.update_weights(_payload(request, "update_info"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.weights.finish_weight_update(weight_version)

    async def abort_weight_update(self) -> None:
        """Drop the update under way on every replica; they keep the weights they serve."""
        await self.weights.abort()

    async def update_weight_version(self, new_version: str) -> None:
        await self.weights.update_weight_version(new_version)

    async def get_weight_version(self) -> str:
        return await self.weights.get_weight_version()

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        return await self.weights.compute_weight_checksums()

    @asynccontextmanager
    async def weight_update(self, version: str, mode: str = "wait") -> AsyncIterator["StageControl"]:
        """The fence around one push: pause (``mode`` as ``pause_generation``), start the update,
        run the body (its ``update_weights`` calls), finish with ``version`` on every replica,
        reset the prefix cache, resume. A body that raises aborts the update (nothing loads).

        Under ``wait`` and ``abort`` no request spans two versions; under ``keep`` the
        requests frozen in the llm stages go on under the new weights (their spans say so).
        Requests that arrive meanwhile wait and are served by the new version.
        """
        check_version_order(self.weights.version, version)
        await self.pause_generation(mode=mode, clear_cache=False)
        try:
            await self.weights.start_weight_update()
            try:
                yield self
            except BaseException:
                await self.weights.abort()
                raise
            await self.weights.finish_weight_update(version)
            # KV computed by the old weights must not be reused by new requests (blocks of
            # requests kept under ``keep`` are still held: those are theirs).
            await self._call_stages("reset_prefix_cache", stage_ids=self.weights.stage_ids)
        finally:
            await self.resume_generation()

    # ----------------------------------------------- calls into the stages
    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None,
        stage_ids: Sequence[int] | None = None,
    ) -> list[Any]:
        """vLLM's ``collective_rpc`` on the workers of the chosen (default: every LLM) stage: one
        result per worker, over every replica of those stages."""
        chosen = self._chosen_stages(stage_ids, llm_only=stage_ids is None)
        per_stage = await asyncio.gather(*(ctx.client.call_each_replica_async(
            "collective_rpc", method=method, timeout=timeout, args=tuple(args), kwargs=kwargs) for ctx in chosen))
        return [worker for results in per_stage for _, workers in sorted(results.items()) for worker in workers]

    def _chosen_stages(self, stage_ids: Sequence[int] | None, llm_only: bool, theta: bool = True) -> list[StageContext]:
        unknown = set(stage_ids or ()) - {ctx.stage_id for ctx in self.stage_contexts}
        if unknown:
            raise ValueError(f"no stage {sorted(unknown)} in this pipeline")
        chosen = [ctx for ctx in self.stage_contexts if stage_ids is None or ctx.stage_id in stage_ids]
        if not theta:
            chosen = [ctx for ctx in chosen if ctx.stage_id not in self.theta_stage_ids]
        return [ctx for ctx in chosen if ctx.stage_type in (None, "llm")] if llm_only else chosen

    @property
    def theta_stage_ids(self) -> frozenset[int]:
        """The llm stages that score for a mixing teacher (``mixing.theta_stage``)."""
        return frozenset(ctx.stage_config.mixing.theta_stage for ctx in self.stage_contexts
                         if ctx.stage_config is not None and ctx.stage_config.mixing is not None)

    async def _call_stages(self, utility: str, /, *, stage_ids: Sequence[int] | None = None, llm_only: bool = False,
                           theta: bool = True, **kwargs: Any) -> list[Any]:
        chosen = self._chosen_stages(stage_ids, llm_only, theta)
        return list(await asyncio.gather(*(ctx.client.call_utility_async(utility, **kwargs) for ctx in chosen)))

    async def engine_metrics(self, timeout: float = 2.0) -> dict[tuple[int, int], list[Any]]:
        """The metric families each live stage replica keeps ((stage id, replica) -> snapshot,
        ``prometheus_snapshot`` format): an llm stage's vLLM ``vllm:*`` series, every stage's deadline
        figures; one that does not answer within ``timeout`` is left out."""
        chosen = [ctx for ctx in self.stage_contexts if not ctx.client.is_dead]
        per_stage = await asyncio.gather(
            *(ctx.client.call_each_replica_async("engine_metrics", call_timeout=timeout, return_exceptions=True)
              for ctx in chosen), return_exceptions=True)
        return {(ctx.stage_id, replica): snapshot
                for ctx, results in zip(chosen, per_stage) if not isinstance(results, BaseException)
                for replica, snapshot in results.items() if not isinstance(snapshot, BaseException)}

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._call_stages("sleep", llm_only=True, level=level, mode=mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        await self._call_stages("wake_up", llm_only=True, tags=tags)
        return True

    async def is_sleeping(self) -> bool:
        return any(await self._call_stages("is_sleeping", llm_only=True))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return all(await self._call_stages("reset_prefix_cache", llm_only=True,
                                           reset_running_requests=reset_running_requests,
                                           reset_connector=reset_connector))

    async def reset_mm_cache(self) -> None:
        await self._call_stages("reset_mm_cache", llm_only=True)

    async def reset_encoder_cache(self) -> None:
        await self._call_stages("reset_encoder_cache", llm_only=True)

    async def start_profile(self, profile_prefix: str | None = None, **kwargs: Any) -> None:
        await self._call_stages("start_profile", llm_only=True)

    async def stop_profile(self) -> None:
        await self._call_stages("stop_profile", llm_only=True)

    @property
    def lora_stage_ids(self) -> list[int]:
        """The llm stages that run LoRA adapters (``engine_args.enable_lora``)."""
        return lora_stage_ids(ctx.stage_config for ctx in self.stage_contexts if ctx.stage_config is not None)

    async def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter into the stages that run adapters, every replica of each (vLLM's
        ``--lora-modules`` and ``/v1/load_lora_adapter`` call it before the adapter is served)."""
        stages = self.lora_stage_ids
        if not stages:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: no llm stage of this pipeline runs adapters "
                             f"(set engine_args.enable_lora on the stage it is for)")
        try:
            return all(await self._call_stages("add_lora", stage_ids=stages, lora_request=lora_request))
        except Exception as exc:  # (vLLM's message says what is wrong with it, ours which adapter)
            raise RuntimeError(f"LoRA adapter {lora_request.lora_name!r} ({lora_request.lora_path}): {exc}") from exc

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError("release_kv_cache_memory is not supported by omni_engine pipelines")

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("KV transfer is not supported by omni_engine pipelines")


def _payload(request: Any, field: str) -> Any:
    """vLLM's request dataclass (``WeightTransferInitRequest`` ...) or its payload as is."""
    return getattr(request, field) if hasattr(request, field) else request
