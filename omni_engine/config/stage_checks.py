"""Checks of one stage of a pipeline config: its runtime, its engine, its inputs.

The per-stage half of the checks (``pipeline_checks`` has what needs the whole
pipeline: the graph, edges, security, placement). Everything here reports
problems instead of raising.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omni_engine.config.convert import Report, check_dotted
from omni_engine.config.model import (
    AFFINITIES,
    EVENT_LOOPS,
    LOAD_BALANCE_POLICIES,
    RESTART_POLICIES,
    RETRY_POLICIES,
    STAGE_IO,
    StageConfig,
    StageRuntimeConfig,
    cpu_list,
    device_parts,
)
from omni_engine.logits.check import check_logits_processors
from omni_engine.stage_engine.stage_sockets import check_host


def check_stage(
    stage: StageConfig,
    path: str,
    report: Report,
    known_ids: set[int] | None,
    stage_types: Iterable[str],
    transports: Iterable[str],
    output_types: Iterable[str],
) -> None:
    """Everything about one stage that does not need the whole graph.

    ``known_ids`` is None when some stage has no usable id: references are then
    not judged (they might point at that stage).
    """
    stage_types, output_types = tuple(stage_types), tuple(output_types)
    if stage.stage_type not in stage_types:
        report(f"{path}.stage_type", f"unknown stage_type {stage.stage_type!r}; expected one of {list(stage_types)}")
    _check_runtime(stage, path, report, tuple(transports))
    _check_engine(stage, path, report)
    if stage.final_output_type is not None and stage.final_output_type not in output_types:
        report(f"{path}.final_output_type",
               f"unknown final_output_type {stage.final_output_type!r}; expected one of {list(output_types)}")
    elif stage.final_output and stage.final_output_type is None:
        report(f"{path}.final_output_type",
               f"missing; required when final_output is true; expected one of {list(output_types)}")
    _check_inputs(stage, path, report, known_ids)


def _check_runtime(stage: StageConfig, path: str, report: Report, transports: tuple[str, ...]) -> None:
    """A stage's ``runtime``: how and where its processes (or threads) run."""
    runtime = stage.runtime
    if runtime.transport not in transports:
        report(f"{path}.runtime.transport",
               f"unknown transport {runtime.transport!r}; expected one of {list(transports)}")
    if runtime.restart not in RESTART_POLICIES:
        report(f"{path}.runtime.restart",
               f"unknown restart policy {runtime.restart!r}; expected one of {list(RESTART_POLICIES)}")
    if runtime.max_restarts is not None and runtime.restart != "on-failure":
        report(f"{path}.runtime.max_restarts", f"applies only with restart: on-failure (this stage has restart: "
                                               f"{runtime.restart!r})")
    if runtime.warm_spare and runtime.restart != "on-failure":
        report(f"{path}.runtime.warm_spare", f"applies only with restart: on-failure (this stage has restart: "
                                             f"{runtime.restart!r})")
    elif runtime.warm_spare and runtime.transport != "ipc":
        report(f"{path}.runtime.warm_spare", f"a warm spare waits on this host: it applies to transport: ipc "
                                             f"(this stage uses {runtime.transport!r})")
    if not runtime.process:
        _check_in_process(stage, f"{path}.runtime.process", report)
    _check_event_loop(runtime, f"{path}.runtime.event_loop", report)
    _check_io(runtime, f"{path}.runtime.io", report)
    if runtime.devices is not None:
        _check_devices(runtime.devices, f"{path}.runtime.devices", report)
    if runtime.cpus is not None:
        try:
            cores = cpu_list(runtime.cpus)
        except ValueError as exc:
            report(f"{path}.runtime.cpus", str(exc))
        else:
            if len(cores) % runtime.num_replicas:
                report(f"{path}.runtime.cpus", f"{len(cores)} core(s) cannot be shared out equally over "
                                               f"num_replicas: {runtime.num_replicas}")
    _check_replicas(stage, f"{path}.runtime", report)
    batch, max_num_seqs = runtime.max_batch_size, stage.engine_args.get("max_num_seqs")
    if stage.stage_type == "llm" and batch is not None and max_num_seqs is not None and batch != max_num_seqs:
        report(f"{path}.runtime.max_batch_size",
               f"{batch} differs from engine_args.max_num_seqs ({max_num_seqs}); for an llm stage they are the "
               "same setting: give one, or the same value")
    host = runtime.host
    if host is not None and runtime.transport != "tcp":
        report(f"{path}.runtime.host", f"host {host!r} applies only to transport: tcp "
                                       f"(this stage uses {runtime.transport!r})")
    elif host is not None and (problem := check_host(host)) is not None:
        report(f"{path}.runtime.host", f"{problem}; expected the address to bind, e.g. 127.0.0.1 (the default)")


def _check_engine(stage: StageConfig, path: str, report: Report) -> None:
    """What the stage's engine is built from: its model, its factory, its environment."""
    for key in stage.env:
        if key.startswith("OMNI_ENGINE_"):
            report(f"{path}.env.{key}", "omni_engine's settings are not read in stage processes; set tensor "
                                        "transfer in runtime.connectors, others in the client's environment")
    model = stage.engine_args.get("model")
    if stage.stage_type == "llm" and not (isinstance(model, str) and model):
        report(f"{path}.engine_args.model",
               f"missing or not a string (got {model!r}); an llm stage needs a model name or path")
    if stage.stage_type == "llm":
        check_logits_processors(stage.engine_args.get("logits_processors"),
                                f"{path}.engine_args.logits_processors", report)
    if stage.stage_type == "generation":
        if "model_factory" not in stage.engine_args:
            report(f"{path}.engine_args.model_factory",
                   "missing; a generation stage needs a dotted path 'pkg.module:factory' to build its model")
        else:
            check_dotted(stage.engine_args["model_factory"], "model_factory",
                         f"{path}.engine_args.model_factory", report)


def _check_inputs(stage: StageConfig, path: str, report: Report, known_ids: set[int] | None) -> None:
    """Which stages feed this one, and the processor that turns their outputs into its input."""
    seen: set[int] = set()
    for i, src in enumerate(stage.engine_input_source):
        where = f"{path}.engine_input_source[{i}]"
        if src == stage.stage_id:
            report(where, f"stage {stage.stage_id} lists itself as its own input; a stage cannot feed itself")
        elif known_ids is not None and src not in known_ids:
            report(where, f"engine_input_source refers to stage {src}, which does not exist "
                          f"(stage ids: {sorted(known_ids)})")
        elif src in seen:
            report(where, f"stage {src} is listed twice")
        seen.add(src)
    if stage.custom_process_input_func is not None:
        check_dotted(stage.custom_process_input_func, "custom_process_input_func",
                     f"{path}.custom_process_input_func", report)


def _check_in_process(stage: StageConfig, field_path: str, report: Report) -> None:
    """What a stage in a thread of the client cannot have (``runtime.process: false``)."""
    runtime = stage.runtime
    refused = []
    if stage.stage_type != "generation":
        refused.append(f"stage_type {stage.stage_type!r} (only generation stages run in-process; an llm stage's "
                       "vLLM needs a process of its own)")
    if runtime.num_replicas != 1:
        refused.append(f"num_replicas: {runtime.num_replicas} (an in-process stage is one thread)")
    if runtime.restart != "no":
        refused.append(f"restart: {runtime.restart} (a thread cannot be killed and started again)")
    if runtime.devices is not None:
        refused.append("devices (they are given to a process through its environment)")
    if runtime.cpus is not None:
        refused.append("cpus (a thread runs where its process does)")
    if runtime.nice:
        refused.append("nice (a thread runs at its process's priority)")
    if stage.env:
        refused.append("env (a thread shares the client's environment)")
    if runtime.transport != "ipc" or runtime.host is not None:
        refused.append("transport/host (an in-process stage is reached over inproc://)")
    for what in refused:
        report(field_path, f"process: false cannot be combined with {what}")


def _check_event_loop(runtime: StageRuntimeConfig, field_path: str, report: Report) -> None:
    """Where an in-process stage's event loop runs; meaningless for a stage process."""
    if runtime.event_loop is None:
        return
    if runtime.event_loop not in EVENT_LOOPS:
        report(field_path, f"{runtime.event_loop!r} is not one of {list(EVENT_LOOPS)}")
    elif runtime.process:
        report(field_path, "applies to in-process stages only (process: false); a stage process runs its own loop")


def _check_io(runtime: StageRuntimeConfig, field_path: str, report: Report) -> None:
    """Where a stage process's socket I/O runs; an in-process stage's runs on its loop."""
    if runtime.io is None:
        return
    if runtime.io not in STAGE_IO:
        report(field_path, f"{runtime.io!r} is not one of {list(STAGE_IO)}")
    elif not runtime.process and runtime.io != "loop":
        report(field_path, "applies to stage processes only; an in-process stage (process: false) does its I/O "
                           "on its event loop")


def _check_replicas(stage: StageConfig, path: str, report: Report) -> None:
    """``num_replicas`` and the fields that say how replicas share work and fail."""
    runtime = stage.runtime
    n = runtime.num_replicas
    for name, allowed in (("load_balance", LOAD_BALANCE_POLICIES), ("affinity", AFFINITIES),
                          ("retry", RETRY_POLICIES)):
        value = getattr(runtime, name)
        if value is None:
            continue
        if value not in allowed:
            report(f"{path}.{name}", f"unknown {name} {value!r}; expected one of {list(allowed)}")
        elif n == 1:
            report(f"{path}.{name}", "applies only with num_replicas > 1 (this stage has one replica)")
    if runtime.devices is not None and n > 1:
        count = len(device_parts(runtime.devices))
        if count % n:
            report(f"{path}.devices", f"{count} device(s) cannot be shared out equally over num_replicas: {n}; "
                                      f"give each replica the same number (e.g. {n} devices, one each)")


def _check_devices(devices: Any, field_path: str, report: Report) -> None:
    """Ids are non-negative integers or device names (e.g. GPU UUIDs), each given once."""
    ids = []
    for part in device_parts(devices):
        device = str(part).strip()
        if (isinstance(part, int) and part < 0) or not device or any(c.isspace() or c == "," for c in device):
            report(field_path, f"invalid device id {part!r}; expected non-negative integers or device names, "
                               "as \"0,1\", 0 or [0, 1]")
            return
        ids.append(device)
    if not ids:
        report(field_path, "empty; list the device ids, or leave the field out")
    duplicates = sorted({d for d in ids if ids.count(d) > 1})
    if duplicates:
        report(field_path, f"device {duplicates[0]!r} is listed twice")
