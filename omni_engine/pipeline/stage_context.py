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
    def input_processor_args(self) -> dict[str, Any]:
        return dict(self.stage_config.custom_process_input_args) if self.stage_config else {}

    @property
    def stage_type(self) -> str | None:
        return self.stage_config.stage_type if self.stage_config else None

    @property
    def name(self) -> str:
        """A short name for logs and spans: the generation model's factory (``make_`` dropped), or
        the last part of the llm's model path; ``stage<id>`` when the config names neither."""
        args = self.stage_config.engine_args if self.stage_config else {}
        factory = args.get("model_factory")
        if isinstance(factory, str):
            return factory.rpartition(":")[2].rpartition(".")[2].removeprefix("make_")
        model = args.get("model")
        if isinstance(model, str) and model.strip("/"):
            return model.rstrip("/").rpartition("/")[2]
        return f"stage{self.stage_id}"
