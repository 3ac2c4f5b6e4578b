"""``AsyncOmni``: vLLM-Omni's public entry point, on either architecture.

``VLLM_OMNI_USE_NEW_ARCHITECTURE=1`` (the default) runs the pipeline on ZMQ
stage processes behind ``MultiStageEngineClient``; ``0`` on the legacy
``multiprocessing.Queue`` stage processes (deprecated). Both take the same
stage configs and give the same outputs and errors: the flag changes how
stages are reached, nothing a caller sees.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import warnings
from collections.abc import AsyncGenerator, Iterable, Sequence
from pathlib import Path
from typing import Any

from omni_engine import envs
from omni_engine.config import PipelineConfig, read_pipeline_yaml
from omni_engine.config.for_model import parse_with_deploy, pipeline_data_for_model
from omni_engine.entrypoints.multi_stage_engine_client import (
    MultiStageEngineClient,
    Progress,
)
from omni_engine.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

_LEGACY_WARNING = ("VLLM_OMNI_USE_NEW_ARCHITECTURE=0 selects the legacy multiprocessing.Queue architecture, "
                   "which is deprecated: the ZMQ architecture (the default) is faster on every benchmark row "
                   "(benchmarks/README.md) and will be the only one.")


class AsyncOmni:
    """A multi-stage pipeline: ``generate`` streams every final stage's outputs.

    ``AsyncOmni(model=...)`` alone runs the pipeline of that model's family (a
    Qwen2.5-Omni checkpoint: thinker -> talker -> code2wav), found by its
    ``architectures``, or else one vLLM stage of it; with ``stage_configs_path``
    the YAML config says the stages, and ``model`` (if given) is the model of
    its ``llm`` stages; ``deploy_config``: vLLM-Omni's deploy YAML over the
    pipeline (``omni_engine.config.deploy``). Other keyword arguments are
    vLLM engine arguments for the ``llm`` stages (``max_model_len=...``).
    Stages start on ``await start()``, ``async with``, or the first request.
    """

    def __init__(
        self,
        model: str | None = None,
        stage_configs_path: str | Path | None = None,
        *,
        use_new_architecture: bool | None = None,
        progress: Progress | None = None,
        deploy_config: str | Path | None = None,
        **engine_args: Any,
    ) -> None:
        self.config = pipeline_config_for(model, stage_configs_path, engine_args, deploy_config)
        self.use_new_architecture = envs.use_new_architecture() if use_new_architecture is None \
            else use_new_architecture
        if not self.use_new_architecture:
            warnings.warn(_LEGACY_WARNING, DeprecationWarning, stacklevel=2)
            logger.warning("%s", _LEGACY_WARNING)
        self.engine: MultiStageEngineClient | None = None
        self._progress = progress
        self._starting: asyncio.Lock | None = None
        self._stopped = False

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> "AsyncOmni":
        """Start every stage process (idempotent)."""
        if self._stopped:
            raise RuntimeError("AsyncOmni is shut down")
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.engine is None:
                if self.use_new_architecture:
                    self.engine = await MultiStageEngineClient.from_config(self.config, progress=self._progress)
                else:
                    from omni_engine.legacy import start_legacy_pipeline

                    self.engine = await start_legacy_pipeline(self.config, progress=self._progress)
        return self

    async def __aenter__(self) -> "AsyncOmni":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown_async()

    async def shutdown_async(self) -> None:
        """Stop every stage process; idempotent."""
        self._stopped = True
        if self.engine is not None:
            await self.engine.shutdown_async()

    def shutdown(self, timeout: float | None = None) -> None:
        """Synchronous, idempotent, from any context (``MultiStageEngineClient.shutdown``)."""
        self._stopped = True
        if self.engine is not None:
            self.engine.shutdown(timeout)

    # ---------------------------------------------------------- generation
    async def generate(
        self,
        prompt: Any,
        request_id: str,
        sampling_params_list: Sequence[Any] | None = None,
        *,
        final_stage_id: int | Sequence[int] | None = None,
        execution_mode: str | None = None,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """Stream the final outputs of one request (``finished`` on each final stage's last).

        ``sampling_params_list`` holds one entry per stage, in stage order (a
        missing or None entry uses the stage's ``default_sampling_params``).
        Leaving the stream early aborts the request on every stage.
        """
        engine = await self._engine()
        params = list(sampling_params_list) if sampling_params_list is not None else [None]
        stream = engine.generate(prompt, params, request_id, final_stage_id=final_stage_id,
                                 execution_mode=execution_mode)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def check_health(self) -> None:
        await (await self._engine()).check_health()

    @property
    def is_running(self) -> bool:
        return self.engine is not None and self.engine.is_running

    @property
    def errored(self) -> bool:
        return self.engine is not None and self.engine.errored

    async def _engine(self) -> MultiStageEngineClient:
        if self.engine is None:
            await self.start()
        return self.engine


def pipeline_config_for(model: str | None, stage_configs_path: str | Path | None,
                        engine_args: dict[str, Any], deploy_config: str | Path | None = None) -> PipelineConfig:
    """The validated pipeline ``AsyncOmni(model, stage_configs_path, **engine_args)`` runs: the YAML
    at ``stage_configs_path``, else the one ``model`` names (its family's by architecture, or one vLLM
    stage: ``omni_engine.config.for_model``); ``engine_args`` (and ``model``) go to every llm stage,
    then vLLM-Omni's deploy YAML ``deploy_config`` (``omni_engine.config.deploy``) over all of it."""
    if stage_configs_path is None:
        if model is None:
            raise ValueError("AsyncOmni needs model= (a checkpoint: its family's pipeline, or one vLLM "
                             "stage) or stage_configs_path=")
        source, data = pipeline_data_for_model(model)
    else:
        source = str(stage_configs_path)
        data = copy.deepcopy(read_pipeline_yaml(stage_configs_path))
    overrides = dict(engine_args, **({"model": model} if model is not None else {}))
    if overrides and isinstance(data, dict) and isinstance(data.get("stage_args"), list):
        for stage in data["stage_args"]:
            if isinstance(stage, dict) and stage.get("stage_type", "llm") == "llm":
                stage["engine_args"] = {**(stage.get("engine_args") or {}), **overrides}
    notes: list[str] = []
    config = parse_with_deploy(data, source, deploy_config, notes)
    for note in notes:
        logger.info("%s", note)
    if stage_configs_path is not None:
        config.source_path = str(stage_configs_path)
    return config


__all__ = ["AsyncOmni", "pipeline_config_for"]
