"""Exceptions a caller of omni_engine may see. Each names the stage (and request).

``StageDeadError`` is a vLLM ``EngineDeadError`` and ``StageRequestError`` an
``EngineGenerateError``, so vLLM's serving code treats them as it treats its
own engine's failures (500 and shut down vs. an error for one request).
"""

from __future__ import annotations

from http import HTTPStatus

from vllm.exceptions import GracefulHTTPError
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError


class StageDeadError(EngineDeadError):
    """A stage process died or reported a fatal error; it serves nothing more.

    Of a replicated stage: ``replica`` names the replica that died, and
    ``request_id`` the request that was lost with it (the stage lives on in
    its other replicas).
    """

    def __init__(self, stage_id: int, message: str, exit_code: int | None = None, *,
                 replica: int | None = None, request_id: str | None = None) -> None:
        super().__init__()
        self.stage_id = stage_id
        self.exit_code = exit_code
        self.message = message
        self.replica = replica
        self.request_id = request_id
        self.args = (message,)

    def __str__(self) -> str:
        return self.message


class StageRequestError(EngineGenerateError):
    """One request failed in one stage; the stage lives on."""

    def __init__(self, stage_id: int, request_id: str | None, message: str, error_type: str = "Error") -> None:
        super().__init__(message)
        self.stage_id = stage_id
        self.request_id = request_id
        self.error_type = error_type
        self.message = message

    def __str__(self) -> str:
        return self.message


class StageStartupError(RuntimeError):
    """A stage did not become ready (died while loading, or timed out)."""

    def __init__(self, stage_id: int, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.stage_id = stage_id
        self.exit_code = exit_code


class PipelineOverloadedError(GracefulHTTPError):
    """The pipeline is at a limit (``runtime.max_inflight_requests``, or a caller
    not reading ``runtime.max_undelivered_outputs`` outputs); vLLM's server
    answers it with HTTP 503, which clients and load balancers retry."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)
        self.request_id = request_id

    def __str__(self) -> str:
        return self.message
