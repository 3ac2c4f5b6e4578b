"""Reading a pipeline config: YAML -> validated ``PipelineConfig``, every problem in one
``ConfigError`` (file, stage and dotted field path per line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from omni_engine.config import pipeline_checks as pc
from omni_engine.config.convert import ErrorCollector, convert_struct, stage_label
from omni_engine.config.model import (
    EXECUTION_MODES,
    FINAL_OUTPUT_TYPES,
    STAGE_TYPES,
    TRANSPORTS,
    WEIGHT_BACKENDS,
    ConfigError,
    PipelineConfig,
    StageConfig,
)
from omni_engine.config.stage_checks import check_stage


def parse_pipeline_config(data: Any, source: str = "<dict>") -> PipelineConfig:
    """Validate an already-loaded YAML mapping; raise one ConfigError with every problem."""
    errors = ErrorCollector(source)
    report = errors.pipeline()
    if not isinstance(data, dict):
        got = "null (empty file?)" if data is None else type(data).__name__
        raise ConfigError([f"{source}: expected a mapping with 'stage_args' at the top level, got {got}"], source)
    shell = convert_struct({k: v for k, v in data.items() if k != "stage_args"} | {"stage_args": []},
                              PipelineConfig, "", report)
    raw_stages = data.get("stage_args")
    if not isinstance(raw_stages, list) or not raw_stages:
        report("stage_args", "missing or empty; expected a non-empty list of stages"
               if raw_stages in (None, []) else f"expected a list of stages, got {type(raw_stages).__name__}")
        raw_stages = []
    converted: list[tuple[int, StageConfig]] = []
    placed = shell is not None and shell.runtime.placement.backend == "ray"
    for i, raw in enumerate(raw_stages):
        stage = convert_struct(raw, StageConfig, f"stage_args[{i}]", errors.for_stage(stage_label(i, raw)))
        if stage is not None:
            if placed and stage.runtime.process and "transport" not in (raw.get("runtime") or {}):
                # A stage placed through Ray is reached over the network: tcp is its default.
                stage.runtime.transport = "tcp"
            converted.append((i, stage))
    # Ids of every stage, converted or not, so references are not misreported as missing.
    valid_ids = [r["stage_id"] for r in raw_stages if isinstance(r, dict) and type(r.get("stage_id")) is int]
    all_ids = set(valid_ids) if len(valid_ids) == len(raw_stages) else None
    first_index: dict[int, int] = {}
    for i, stage in converted:
        label = f"stage {stage.stage_id}"
        if stage.stage_id in first_index:
            errors.add(f"stage_args[{i}].stage_id", f"duplicate stage_id {stage.stage_id} (also "
                       f"stage_args[{first_index[stage.stage_id]}]); stage ids must be unique", label)
        first_index.setdefault(stage.stage_id, i)
        check_stage(stage, f"stage_args[{i}]", errors.for_stage(label), all_ids,
                       STAGE_TYPES, TRANSPORTS, FINAL_OUTPUT_TYPES)
    if shell is not None:
        sources = {s.stage_id: list(s.engine_input_source) for _, s in converted}
        pc.check_runtime(shell.runtime, report, sources, all_ids, EXECUTION_MODES)
        pc.check_security(shell.runtime.security, report, _config_dir(source))
        pc.check_placement(shell, converted, errors)
        pc.check_weights(shell.weights, [s for _, s in converted], report, WEIGHT_BACKENDS)
        if shell.runtime.security.curve:
            for i, stage in converted:
                if not stage.runtime.process:
                    errors.add(f"stage_args[{i}].runtime.process", "an in-process stage (process: false) is reached "
                               "over inproc://, which nothing outside this process can reach: CURVE "
                               "(runtime.security.curve) does not apply to it; run it as a process or turn "
                               "CURVE off", f"stage {stage.stage_id}")
    if all_ids is not None:
        from omni_engine.logits.check import check_mixing

        check_mixing(converted, errors)
    if raw_stages and len(converted) == len(raw_stages) and len(first_index) == len(converted):
        pc.check_graph(converted, errors)
    if errors.errors or shell is None:
        raise ConfigError(errors.errors, source)
    config = PipelineConfig(stage_args=[s for _, s in converted], runtime=shell.runtime, weights=shell.weights)
    return config.with_traces_endpoint(shell.runtime.otlp_traces_endpoint)


def _config_dir(source: str) -> Path:
    """Where relative paths in a config point from: its file's directory, else the cwd."""
    path = Path(source)
    return path.parent if path.is_file() else Path.cwd()


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML of a config file (``what``: "pipeline config", ...), not yet validated."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: {what} file not found"], str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read {what}: {exc}"], str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = ", ".join(p for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
        raise ConfigError([f"{path}: {where}YAML syntax error: {problem or exc}"], str(path)) from None


def read_pipeline_yaml(path: str | Path) -> Any:
    """The YAML of a pipeline config file, not yet validated (callers may adjust it first)."""
    return read_yaml(path, "pipeline config")


def load_pipeline_config(path: str | Path) -> PipelineConfig:
    """Read and validate a pipeline YAML file; ``source_path`` records where it came from."""
    config = parse_pipeline_config(read_pipeline_yaml(path), str(path))
    config.source_path = str(path)
    return config
