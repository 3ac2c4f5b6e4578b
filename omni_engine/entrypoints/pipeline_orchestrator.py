"""The seed's import path of ``PipelineOrchestrator`` (it lives in ``omni_engine.pipeline``)."""

from omni_engine.pipeline.orchestrator import (  # noqa: F401
    EXECUTION_MODES,
    PipelineOrchestrator,
    RequestAbortedError,
)

__all__ = ["EXECUTION_MODES", "PipelineOrchestrator", "RequestAbortedError"]
