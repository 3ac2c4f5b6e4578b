"""The legacy architecture: stage processes fed by ``multiprocessing.Queue``.

vLLM-Omni before RFC 967, kept as the baseline the new architecture is
measured against (``benchmarks/``) and as a fallback while it is proven:
``AsyncOmni`` uses it when ``VLLM_OMNI_USE_NEW_ARCHITECTURE=0``. Deprecated.
"""

from omni_engine.legacy.omni_stage import LegacyOutputHandler, OmniStage
from omni_engine.legacy.pipeline import start_legacy_pipeline

__all__ = ["LegacyOutputHandler", "OmniStage", "start_legacy_pipeline"]
