"""LoRA adapters through a pipeline: which stages run them, and a request's adapter per stage.

An llm stage runs adapters when its ``engine_args`` set vLLM's ``enable_lora`` (with
``max_lora_rank`` and ``max_loras`` as vLLM takes them); vLLM loads an adapter at its first request
(or at ``add_lora``) and mixes requests of different adapters, and none, in one batch. A request
names its adapter as vLLM's ``LoRARequest``: for the pipeline's text (or entry) stage, or per stage
as ``{stage_id: LoRARequest}``; stages it does not name run their base weights, and downstream
stages (a talker, a vocoder) get what the adapted stage wrote.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

LORA_ENGINE_ARG = "enable_lora"


def lora_stage_ids(stage_configs: Iterable[Any]) -> list[int]:
    """The llm stages whose engine runs LoRA adapters (``engine_args.enable_lora``)."""
    return [stage.stage_id for stage in stage_configs
            if stage.stage_type in (None, "llm") and (stage.engine_args or {}).get(LORA_ENGINE_ARG)]


def lora_requests_by_stage(lora_request: Any, default_stage: int | None, lora_stages: Iterable[int],
                           request_id: str) -> dict[int, Any]:
    """``lora_request`` (one adapter, for ``default_stage``; or stage id -> adapter) by stage,
    checked: every named stage runs adapters. A ``ValueError`` names the request, the stage and why."""
    by_stage = dict(lora_request) if isinstance(lora_request, Mapping) else {default_stage: lora_request}
    allowed = sorted(lora_stages)
    for stage_id, adapter in by_stage.items():
        name = getattr(adapter, "lora_name", None)
        if name is None:
            raise ValueError(f"request {request_id!r}: lora_request for stage {stage_id} must be vLLM's "
                             f"LoRARequest, got {type(adapter).__name__}")
        if stage_id not in allowed:
            where = (f"its stages that do are {allowed}" if allowed
                     else "none of its llm stages sets engine_args.enable_lora")
            raise ValueError(f"request {request_id!r}: LoRA adapter {name!r} for stage {stage_id}, which runs no "
                             f"adapters in this pipeline ({where})")
    return by_stage
