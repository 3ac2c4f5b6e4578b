"""Logits processors in pipelines: request-keyed state that survives vLLM's row reuse.

``RequestKeyedLogitsProcessor`` (imports vLLM and torch) is loaded on first use, so
config checks and the stage's request tagging stay light.
"""

from typing import Any

from omni_engine.logits.slot_table import REQUEST_ID_KEY, LiveRequest, SlotStats, SlotTable, tag_request

__all__ = ["REQUEST_ID_KEY", "LiveRequest", "RequestKeyedLogitsProcessor", "SlotStats", "SlotTable", "tag_request"]


def __getattr__(name: str) -> Any:
    if name == "RequestKeyedLogitsProcessor":
        from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor

        return RequestKeyedLogitsProcessor
    raise AttributeError(name)
