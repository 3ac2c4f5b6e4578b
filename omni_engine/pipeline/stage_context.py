"""``StageContext``: what the orchestrator knows about one stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_engine.config import StageConfig
from omni_engine.stage_engine.stage_client import StageClient


@dataclass
class StageContext:
    """One stage of a pipeline: its config, its client, and how it ends a request.

    ``stage_config`` may be None for a stage built by hand; the graph then
    follows list order (stage i feeds stage i+1).
    """

    stage_id: int
    stage_config: StageConfig | None
    client: StageClient
    is_final_output: bool = False
    final_output_type: str = "text"

    @property
    def default_sampling_params(self) -> Any:
        return self.stage_config.default_sampling_params if self.stage_config else None

    @property
    def input_processor(self) -> str | None:
        return self.stage_config.custom_process_input_func if self.stage_config else None

    @property
    def stage_type(self) -> str | None:
        return self.stage_config.stage_type if self.stage_config else None
