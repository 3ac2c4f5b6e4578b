"""Weight updates into a running pipeline: the trainer's side (``WeightSender``, the HTTP client)
and the stages' backends (``staging_engine``, loaded inside vLLM's worker)."""

from __future__ import annotations

from typing import Any

__all__ = ["OmniHTTPWeightSyncClient", "WeightSender"]


def __getattr__(name: str) -> Any:
    # Lazily: the sender needs only torch; the HTTP client imports vLLM.
    if name == "WeightSender":
        from omni_engine.weights.sender import WeightSender

        return WeightSender
    if name == "OmniHTTPWeightSyncClient":
        from omni_engine.weights.http_client import OmniHTTPWeightSyncClient

        return OmniHTTPWeightSyncClient
    raise AttributeError(name)
