"""Stages started before the client is: ``omni-engine serve`` launches them before it imports vLLM.

``serve`` imports vLLM's server (seconds) before it can build its client, and the client side
imports vLLM too. The stage processes do not need either: this vLLM-free module starts every stage
that can be adopted later (``stage_engine.stage_launch``), so each stage's own imports run while
the server imports, and ``start_pipeline`` hands each to its client.

Started early: local process stages with one replica on ipc, without CURVE. The others (Ray
placement, replicas, tcp, CURVE, in-process stages) start with their client as before.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_engine.config import PipelineConfig
from omni_engine.pipeline.stage_specs import build_stage_specs
from omni_engine.stage_engine.stage_launch import LaunchedStage, discard_launched, launch_stage


def launchable_stage_ids(config: PipelineConfig) -> list[int]:
    """The stages of ``config`` that can start before their clients."""
    if config.runtime.placement.backend == "ray" or config.runtime.security.curve:
        return []
    return [stage.stage_id for stage in config.stage_args
            if stage.runtime.process and stage.runtime.transport == "ipc" and stage.runtime.host is None
            and (stage.runtime.num_replicas or 1) == 1]


def launch_stages_early(config: PipelineConfig, say: Callable[[str], None]) -> dict[int, LaunchedStage]:
    """Start what ``launchable_stage_ids`` allows now; stage id -> its launched process. If one fails to
    start, the others are stopped again and the error raised."""
    ids = launchable_stage_ids(config)
    if not ids:
        return {}
    specs = build_stage_specs(config)
    launched: dict[int, LaunchedStage] = {}
    try:
        for sid in ids:
            launched[sid] = launch_stage(sid, specs[sid][0])
            say(f"stage {sid}: process started (pid {launched[sid].process.pid})")
    except BaseException:
        discard_launched(launched)
        raise
    return launched


__all__ = ["discard_launched", "launch_stages_early", "launchable_stage_ids"]
