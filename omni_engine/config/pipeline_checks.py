"""Checks that need the whole pipeline config: runtime, edges, security, placement,
weights and the stage graph. Like every check here, they report problems instead of raising.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from omni_engine.config.convert import ErrorCollector, Report, check_dotted
from omni_engine.config.model import (
    PLACEMENT_BACKENDS,
    PLACEMENT_STRATEGIES,
    EdgeConfig,
    PipelineConfig,
    PipelineRuntimeConfig,
    SecurityConfig,
    StageConfig,
    WeightsConfig,
)
from omni_engine.stage_engine.stage_sockets import is_loopback


def check_runtime(
    runtime: PipelineRuntimeConfig,
    report: Report,
    sources: dict[int, list[int]],
    all_ids: set[int] | None,
    modes: Iterable[str],
) -> None:
    """Pipeline ``runtime``: execution modes and per-edge overrides.

    ``sources`` holds only the stages that converted; an edge into a stage that
    exists but failed to convert is not judged (its error is reported already),
    nor are references at all when ``all_ids`` is None (some stage has no usable id).
    """
    modes = tuple(modes)
    if runtime.connectors.use_shm is False and runtime.connectors.shm_threshold is not None:
        report("runtime.connectors.shm_threshold", "has no effect with use_shm: false (every tensor travels as a "
                                                   "ZMQ frame); remove one of the two")
    if runtime.execution_mode not in modes:
        report("runtime.execution_mode",
               f"unknown execution_mode {runtime.execution_mode!r}; expected one of {list(modes)}")
    seen: set[tuple[int, int]] = set()
    for i, edge in enumerate(runtime.edges):
        _check_edge(edge, f"runtime.edges[{i}]", report, sources, all_ids, modes, seen)


def _check_edge(
    edge: EdgeConfig, path: str, report: Report, sources: dict[int, list[int]],
    all_ids: set[int] | None, modes: tuple[str, ...], seen: set[tuple[int, int]],
) -> None:
    src, dst = edge.from_stage, edge.to
    missing = [(end, sid) for end, sid in (("to", dst), ("from", src)) if all_ids is not None and sid not in all_ids]
    if missing:
        end, sid = missing[0]
        report(f"{path}.{end}", f"edge {src} -> {dst}: stage {sid} does not exist (stage ids: {sorted(all_ids or ())})")
    elif dst in sources and src not in sources[dst]:
        report(path, f"{src} -> {dst} is not an edge of the stage graph: stage {dst}'s engine_input_source "
                     f"is {sources[dst]}; an edge override must match an existing edge")
    if (src, dst) in seen:
        report(path, f"edge {src} -> {dst} is overridden more than once")
    seen.add((src, dst))
    if edge.execution_mode is not None and edge.execution_mode not in modes:
        report(f"{path}.execution_mode",
               f"unknown execution_mode {edge.execution_mode!r}; expected one of {list(modes)}")
    if edge.custom_process_input_func is not None:
        check_dotted(edge.custom_process_input_func, "custom_process_input_func",
                     f"{path}.custom_process_input_func", report)


def check_security(security: SecurityConfig, report: Report, base_dir: Path) -> None:
    """``runtime.security``: key files exist and hold keys, and CURVE is on if they are given.

    Relative key paths are resolved against ``base_dir`` (the config file's
    directory) and stored back absolute, so later loads do not depend on the cwd.
    """
    from omni_engine.stage_engine.security import KeyFileError, KeyPair, curve_available

    for name in ("server_key", "client_key"):
        value = getattr(security, name)
        field_path = f"runtime.security.{name}"
        if value is None:
            continue
        if not security.curve:
            report(field_path, "a key file is set but curve is false; set runtime.security.curve: true")
            continue
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        setattr(security, name, str(path))
        try:
            KeyPair.load(path)
        except KeyFileError as exc:
            report(field_path, str(exc))
    if security.curve and not curve_available():
        report("runtime.security.curve", "this libzmq has no CURVE support (zmq.has('curve') is False)")


def check_placement(config: PipelineConfig, stages: list[tuple[int, StageConfig]], errors: ErrorCollector) -> None:
    """``runtime.placement`` and the per-stage fields that only Ray placement reads.

    A stage placed through Ray is reached over tcp with CURVE from another
    host, so what only makes sense on the client's host is refused with it.
    """
    placement, report = config.runtime.placement, errors.pipeline()
    if placement.backend not in PLACEMENT_BACKENDS:
        report("runtime.placement.backend",
               f"unknown backend {placement.backend!r}; expected one of {list(PLACEMENT_BACKENDS)}")
        return
    ray = placement.backend == "ray"
    if not ray and placement.address is not None:
        report("runtime.placement.address", "applies only with backend: ray")
    if ray and config.runtime.security.client_key is not None:
        report("runtime.security.client_key", "a stage placed through Ray generates its keypair on its own node "
                                              "(only its public key crosses Ray); a fixed client key does not apply")
    for i, stage in stages:
        _check_stage_placement(stage, f"stage_args[{i}].runtime", ray, errors.for_stage(f"stage {stage.stage_id}"))
        if stage.runtime.warm_spare and (ray or config.runtime.security.curve):
            errors.add(f"stage_args[{i}].runtime.warm_spare",
                       "a warm spare is started on the client's host without keys: it applies without Ray placement "
                       "and without CURVE (runtime.security.curve)", f"stage {stage.stage_id}")


# The engine args a weight-update stage gets from the pipeline (``weight_engine_args``).
WEIGHT_ENGINE_ARGS = ("weight_transfer_config", "worker_extension_cls")


def check_weights(weights: WeightsConfig, stages: list[StageConfig], report: Report,
                  backends: tuple[str, ...]) -> None:
    """``weights``: known backend; its stages exist, are llm stages, and leave the engine args
    it sets (the transfer backend, the worker extension) to it."""
    if weights.backend not in backends:
        report("weights.backend", f"unknown backend {weights.backend!r}; expected one of {list(backends)}")
    by_id = {stage.stage_id: stage for stage in stages}
    for sid in weights.stages or ():
        stage = by_id.get(sid)
        if stage is None:
            report("weights.stages", f"no stage {sid} in this pipeline (stages: {sorted(by_id)})")
        elif stage.stage_type != "llm":
            report("weights.stages", f"stage {sid} is a {stage.stage_type!r} stage; weight updates reach "
                                     "llm stages (vLLM) only")
    chosen = weights.stages if weights.stages is not None else [s.stage_id for s in stages if s.stage_type == "llm"]
    for sid in chosen:
        stage = by_id.get(sid)
        for arg in WEIGHT_ENGINE_ARGS:
            if stage is not None and arg in stage.engine_args:
                report("weights", f"stage {sid} sets engine_args.{arg}, which weight updates set (backend "
                                  f"{weights.backend!r}); remove it, or leave the stage out of weights.stages")


def _check_stage_placement(stage: StageConfig, path: str, ray: bool, report: Report) -> None:
    runtime = stage.runtime
    placed = ray and runtime.process
    if not placed:
        why = ("applies only with runtime.placement.backend: ray" if not ray
               else "an in-process stage (process: false) runs in the client's process; Ray places processes")
        for name in ("resources", "strategy"):
            if getattr(runtime, name) is not None:
                report(f"{path}.{name}", why)
        return
    if runtime.strategy is not None:
        if runtime.strategy not in PLACEMENT_STRATEGIES:
            report(f"{path}.strategy",
                   f"unknown strategy {runtime.strategy!r}; expected one of {list(PLACEMENT_STRATEGIES)}")
        elif runtime.num_replicas == 1:
            report(f"{path}.strategy", "applies only with num_replicas > 1 (it lays out a stage's replicas)")
    for name, amount in (runtime.resources or {}).items():
        if not amount >= 0:
            report(f"{path}.resources.{name}", f"{amount!r} is negative; expected an amount >= 0")
    if runtime.resources is not None and not any(runtime.resources.values()):
        report(f"{path}.resources", "reserves nothing; Ray would place the stage anywhere, any number of times "
                                    "over: ask for at least one resource (e.g. {CPU: 1})")
    if runtime.devices is not None:
        report(f"{path}.devices", "Ray gives a placed stage its accelerators: ask for them in runtime.resources "
                                  "(e.g. {GPU: 1})")
    if runtime.transport != "tcp":
        report(f"{path}.transport", f"a stage placed through Ray is reached over tcp (this stage asks for "
                                    f"{runtime.transport!r}); leave transport out")
    if runtime.host is not None and is_loopback(runtime.host):
        report(f"{path}.host", f"{runtime.host!r} is a loopback address, which other nodes cannot reach; "
                               "leave host out (the client binds this node's Ray address) or give a reachable one")


def find_cycles(sources: dict[int, list[int]]) -> list[list[int]]:
    """Cycles of the data-flow graph (src -> consumer), each like ``[0, 1, 0]``.

    Self-loops and references to missing stages are reported elsewhere and
    ignored here. Each cycle is reported once, starting from its first-visited stage: a cycle is
    one back edge of the depth-first search, and each edge is followed once.
    """
    consumers: dict[int, list[int]] = {sid: [] for sid in sources}
    for dst, srcs in sources.items():
        for src in srcs:
            if src in consumers and src != dst:
                consumers[src].append(dst)
    state: dict[int, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[int] = []
    cycles: list[list[int]] = []

    def visit(node: int) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in consumers[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for sid in sorted(sources):
        if sid not in state:
            visit(sid)
    return cycles


def check_graph(stages: list[tuple[int, StageConfig]], collector: ErrorCollector) -> None:
    """Whole-graph checks; only meaningful when every stage converted and ids are unique."""
    index = {s.stage_id: i for i, s in stages}
    sources = {s.stage_id: list(s.engine_input_source) for _, s in stages}
    for cycle in find_cycles(sources):
        first = cycle[0]
        collector.add(f"stage_args[{index[first]}].engine_input_source",
                      f"the stage graph has a cycle {' -> '.join(map(str, cycle))}; "
                      "the graph must be acyclic", f"stage {first}")
    if not any(not s.engine_input_source for _, s in stages):
        collector.add("stage_args[*].engine_input_source",
                      "no entry stage: every stage has an engine_input_source; expected at least one "
                      "stage with engine_input_source [] or missing (it receives the user prompt)")
    if not any(s.final_output for _, s in stages):
        collector.add("stage_args[*].final_output",
                      "no final stage: no stage has final_output: true; expected at least one "
                      "(its outputs are returned to the user)")
