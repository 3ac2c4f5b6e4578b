"""The legacy architecture: stage processes fed by ``multiprocessing.Queue``.

vLLM-Omni before RFC 967, kept as the baseline the new architecture is
measured against (``benchmarks/``) and as a fallback while it is proven:
``AsyncOmni`` uses it when ``VLLM_OMNI_USE_NEW_ARCHITECTURE=0``. Deprecated.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LegacyOutputHandler": "omni_engine.legacy.omni_stage",
    "OmniStage": "omni_engine.legacy.omni_stage",
    "start_legacy_pipeline": "omni_engine.legacy.pipeline",
}


def __getattr__(name: str) -> Any:
    # Lazy: a spawned legacy stage unpickles its StageQueues (this package)
    # before its environment is set, so importing the package must not import vLLM.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LegacyOutputHandler", "OmniStage", "start_legacy_pipeline"]
