"""vLLM-Omni's deploy YAML (``vllm_omni/deploy/<model>.yaml``) over a pipeline's stage config.

vLLM-Omni splits a model's config in two: the pipeline (which stages, how they connect) comes with
the model, and a deploy file says how to run each stage (``stages:`` by ``stage_id`` with
``max_num_seqs``, ``devices``, ``gpu_memory_utilization``, ``enforce_eager``,
``default_sampling_params`` ...), with pipeline-wide engine settings at the top, ``async_chunk``,
and a ``platforms:`` block of overrides per hardware kind. ``--deploy-config FILE`` reads such a
file over the pipeline a model names (or any stage config), as vLLM-Omni users already have them:

- every field we run is honoured: vLLM engine fields go to an llm stage's ``engine_args`` (the
  pipeline-wide ones to every llm stage's)
  (``max_num_seqs`` also to ``runtime.max_batch_size``), ``devices``, ``num_replicas`` and ``env`` to
  the stage, ``default_sampling_params`` over the stage's own, ``async_chunk`` to the pipeline's
  ``execution_mode``, the running platform's ``platforms`` block over the rest;
- a vLLM engine field on a stage that runs no vLLM engine (code2wav is a generation stage here)
  has nothing to act on: it is listed in the returned notes, by name (the published files set
  ``enforce_eager`` and sampling fields on their code2wav stage); a generation stage's
  ``default_sampling_params`` keep only ``seed`` (its noise);
- anything else is refused by name with the reason, all in one ``ConfigError``.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from omni_engine.config.loader import read_yaml
from omni_engine.config.model import ConfigError

# Pipeline-wide vLLM engine settings vLLM-Omni applies to every stage (its DeployConfig).
PIPELINE_ENGINE_FIELDS = ("trust_remote_code", "distributed_executor_backend", "dtype", "quantization",
                          "enable_prefix_caching", "enable_chunked_prefill", "data_parallel_size",
                          "pipeline_parallel_size")
# vLLM-Omni fields with no counterpart here, and why.
UNSUPPORTED = {
    "session_mode": "duplex sessions are not served by omni_engine",
    "duplex_session": "duplex sessions are not served by omni_engine",
    "active_stream_window": "duplex sessions are not served by omni_engine",
    "model_runner": "vLLM's model runner is vLLM's choice per platform here",
    "edges": "edges are the stage config's runtime.edges",
    "pipeline": "the pipeline comes from the checkpoint's architecture or the stage config",
    "custom_voice_dir": "voice cloning is not served by omni_engine",
    "default_pooling_params": "pipelines here generate; they do not pool",
    "subtalker_sampling_params": "no family here has a sub-talker",
    "silence_ban_frames": "no family here bans silence frames",
    "engine_extras": "a stage's extra engine arguments go in the stage config's engine_args",
    "engine_args": "a stage's engine arguments are deploy fields of their own here",
    "runtime": "a stage's runtime is set by devices / num_replicas / max_num_seqs here",
    "async_chunk (per stage)": "set the edge's mode in the stage config's runtime.edges",
}
# vLLM-Omni's connector for stages on one host: ours move stage data over ZMQ frames and shared
# memory (runtime.connectors) whatever a deploy file names; its other connectors span hosts.
SHARED_MEMORY_CONNECTOR = "SharedMemoryConnector"
STAGE_WRAPPER_FIELDS = ("stage_id", "devices", "num_replicas", "env", "default_sampling_params", "max_num_seqs")


def vllm_engine_fields() -> frozenset[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def current_platform() -> str:
    """vLLM-Omni's name for the hardware here (its ``platforms:`` keys): ``cuda``, ``rocm``, ``xpu``,
    ``npu`` or ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "npu" if hasattr(torch, "npu") else "cpu"


def apply_deploy_config(data: dict[str, Any], deploy_path: str | Path,
                        platform: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """``data`` (a stage config's YAML mapping) with the deploy file applied, and the notes on the
    fields that had nothing to act on; ``ConfigError`` naming every refused field."""
    deploy = read_yaml(deploy_path, "deploy config")
    source = str(deploy_path)
    if not isinstance(deploy, dict):
        raise ConfigError([f"{source}: expected a mapping (vLLM-Omni's deploy YAML)"], source, "deploy config")
    data = copy.deepcopy(data)
    errors: list[str] = []
    notes: list[str] = []
    stages = {s.get("stage_id"): s for s in data.get("stage_args") or () if isinstance(s, dict)}
    engine_fields = vllm_engine_fields()
    platform = platform or current_platform()
    layers = [("", deploy)]
    platform_block = (deploy.get("platforms") or {}).get(platform)
    if isinstance(platform_block, dict):
        layers.append((f"platforms.{platform}.", platform_block))
    connectors = {name: connector for prefix, layer in layers
                  for name, connector in _connectors(layer.get("connectors"), f"{source}: {prefix}connectors", errors)}
    for prefix, layer in layers:
        for key, value in layer.items():
            where = f"{source}: {prefix}{key}"
            if key in ("stages", "platforms", "connectors"):
                continue
            if key == "async_chunk":
                data.setdefault("runtime", {})["execution_mode"] = "async_chunk" if value else "sequential"
            elif key in PIPELINE_ENGINE_FIELDS:  # every vLLM engine of the pipeline: its llm stages
                for stage in stages.values():
                    if stage.get("stage_type", "llm") == "llm":
                        _stage_field(stage, key, value, f"{where} (pipeline-wide)", engine_fields, errors, notes)
            elif key in UNSUPPORTED:
                errors.append(f"{where}: not supported: {UNSUPPORTED[key]}")
            else:
                errors.append(f"{where}: not a vLLM-Omni deploy field")
        for index, entry in enumerate(layer.get("stages") or ()):
            where = f"{source}: {prefix}stages[{index}]"
            stage = stages.get(entry.get("stage_id")) if isinstance(entry, dict) else None
            if stage is None:
                errors.append(f"{where}: stage_id {entry.get('stage_id') if isinstance(entry, dict) else entry!r} "
                              f"is not a stage of the pipeline (stages {sorted(stages, key=str)})")
                continue
            for key, value in entry.items():
                if key in ("input_connectors", "output_connectors"):
                    _stage_connectors(stage, key, value, connectors, f"{where}.{key}", errors, notes)
                elif key != "stage_id":
                    _stage_field(stage, key, value, f"{where}.{key}", engine_fields, errors, notes)
    if errors:
        raise ConfigError(errors, source, "deploy config")
    return data, notes


def _stage_field(stage: dict[str, Any], key: str, value: Any, where: str, engine_fields: frozenset[str],
                 errors: list[str], notes: list[str]) -> None:
    """One deploy field onto one stage (its YAML mapping)."""
    llm = stage.get("stage_type", "llm") == "llm"
    runtime = stage.setdefault("runtime", {})
    engine_args = stage.setdefault("engine_args", {})
    if key == "devices":
        runtime["devices"] = value
    elif key == "num_replicas":
        runtime["num_replicas"] = value
    elif key == "env":
        stage["env"] = {**(stage.get("env") or {}), **(value or {})}
    elif key == "max_num_seqs":
        runtime["max_batch_size"] = value
        if llm:
            engine_args["max_num_seqs"] = value
    elif key == "default_sampling_params":
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a mapping, got {type(value).__name__}")
            return
        if not llm:
            dropped = sorted(set(value) - {"seed"})
            value = {k: v for k, v in value.items() if k == "seed"}
            if dropped:
                notes.append(f"{where}: {', '.join(dropped)} have no meaning for stage {stage.get('stage_id')} "
                             "(a generation stage samples no tokens); seed is its noise seed")
        stage["default_sampling_params"] = {**(stage.get("default_sampling_params") or {}), **value}
    elif key == "async_chunk":
        errors.append(f"{where}: not supported: {UNSUPPORTED['async_chunk (per stage)']}")
    elif key in UNSUPPORTED:
        errors.append(f"{where}: not supported: {UNSUPPORTED[key]}")
    elif key in engine_fields:
        if llm:
            engine_args[key] = value
        else:
            notes.append(f"{where}: a vLLM engine field; stage {stage.get('stage_id')} runs no vLLM engine "
                         "(a generation stage), so it has nothing to act on")
    else:
        errors.append(f"{where}: not a vLLM-Omni deploy field nor a vLLM engine argument")


def _connectors(block: Any, where: str, errors: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """A ``connectors:`` block's entries (name -> its ``extra``); a connector that spans hosts is
    refused by name (the stages here share one host's memory)."""
    if block is None:
        return []
    if not isinstance(block, dict):
        errors.append(f"{where}: expected a mapping of connector names, got {type(block).__name__}")
        return []
    out = []
    for name, connector in block.items():
        kind = connector.get("name") if isinstance(connector, dict) else None
        if kind != SHARED_MEMORY_CONNECTOR:
            errors.append(f"{where}.{name}.name: {kind!r} is not supported: stage data moves over ZMQ frames and "
                          f"shared memory here (runtime.connectors); only {SHARED_MEMORY_CONNECTOR} maps onto that")
            continue
        extra = connector.get("extra") or {}
        if not isinstance(extra, dict):
            errors.append(f"{where}.{name}.extra: expected a mapping, got {type(extra).__name__}")
            continue
        out.append((name, extra))
    return out


def _stage_connectors(stage: dict[str, Any], key: str, value: Any, connectors: dict[str, dict[str, Any]],
                      where: str, errors: list[str], notes: list[str]) -> None:
    """A stage's ``input_connectors`` / ``output_connectors`` (``from_stage_N``/``to_stage_N`` ->
    connector name): the connector's ``extra`` fields that the stage's input function takes (Qwen3-Omni's
    codec chunk sizes) become its ``custom_process_input_args``; the rest have nothing to act on."""
    if not isinstance(value, dict):
        errors.append(f"{where}: expected a mapping of stages to connector names, got {type(value).__name__}")
        return
    accepted = _input_parameters(stage.get("custom_process_input_func")) if key == "input_connectors" else set()
    for edge, name in value.items():
        if name not in connectors:
            errors.append(f"{where}.{edge}: connector {name!r} is not in the deploy file's connectors "
                          f"({', '.join(sorted(connectors)) or 'none'})")
            continue
        taken = {k: v for k, v in connectors[name].items() if k in accepted}
        if taken:
            stage["custom_process_input_args"] = {**(stage.get("custom_process_input_args") or {}), **taken}
        ignored = sorted(set(connectors[name]) - set(taken))
        if ignored:
            notes.append(f"{where}.{edge}: {name}'s {', '.join(ignored)} have nothing to act on for stage "
                         f"{stage.get('stage_id')} (its input function takes none of them)")


def _input_parameters(path: Any) -> set[str]:
    """The keyword parameters of a stage's input-processor factory (none without one)."""
    if not isinstance(path, str):
        return set()
    import inspect

    from omni_engine.utils import resolve_dotted

    try:
        factory = resolve_dotted(path, "custom_process_input_func")
    except Exception:  # noqa: BLE001 - the config check names a bad path; nothing to take here
        return set()
    return set(inspect.signature(factory).parameters) - {"sources", "dst", "prompt"}
