"""Weight updates into a running pipeline: the trainer's side (``WeightSender``, the HTTP client)
and the stages' backends (``staging_engine``, loaded inside vLLM's worker)."""

from __future__ import annotations

from typing import Any

__all__ = ["WORKER_EXTENSION", "OmniHTTPWeightSyncClient", "WeightSender"]

# vLLM's worker gets the weight-update methods the pipeline client calls (``omni_check_staged`` ...)
# and the logits processors' (``omni_release_logits_requests``): vLLM takes one extension class.
WORKER_EXTENSION = "omni_engine.weights.worker_extension.WeightUpdateExtension"


def __getattr__(name: str) -> Any:
    # Lazily: the sender needs only torch; the HTTP client imports vLLM.
    if name == "WeightSender":
        from omni_engine.weights.sender import WeightSender

        return WeightSender
    if name == "OmniHTTPWeightSyncClient":
        from omni_engine.weights.http_client import OmniHTTPWeightSyncClient

        return OmniHTTPWeightSyncClient
    raise AttributeError(name)
