"""Checks behind :mod:`omni_engine.config`: YAML data -> Structs, then graph checks.

Kept apart from the schema so that ``config.py`` stays readable. Everything here
*collects* problems into an :class:`ErrorCollector` instead of raising, so that a
user fixing a config sees every mistake at once rather than one per run; and it
all happens before any stage process starts (a bad config must not cost a
25-second vLLM start to find out about).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from omni_engine.stage_engine.stage_sockets import is_loopback
from omni_engine.utils import resolve_dotted

PLACEMENT_BACKENDS = ("local", "ray")
# Ray's placement-group strategies: how one stage's replicas are laid out over nodes.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

if TYPE_CHECKING:
    from omni_engine.config import (
        EdgeConfig,
        PipelineConfig,
        PipelineRuntimeConfig,
        SecurityConfig,
        StageConfig,
        WeightsConfig,
    )

# report(field_path, problem)
Report = Callable[[str, str], None]


class ErrorCollector:
    """Formats each problem as ``<file>: [stage N: ]<field path>: <problem>``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.errors: list[str] = []

    def add(self, path: str, problem: str, stage: str | None = None) -> None:
        where = f"{stage}: " if stage else ""
        self.errors.append(f"{self.source}: {where}{path}: {problem}")

    def pipeline(self) -> Report:
        return lambda path, problem: self.add(path, problem)

    def for_stage(self, label: str) -> Report:
        return lambda path, problem: self.add(path, problem, label)


def stage_label(index: int, raw: Any) -> str:
    """``stage 3`` -- or, when the id itself is unusable, the list index."""
    sid = raw.get("stage_id") if isinstance(raw, dict) else None
    if isinstance(sid, int) and not isinstance(sid, bool):
        return f"stage {sid}"
    return f"stage at index {index} (no valid stage_id)"


# ---------------------------------------------------------------------------
# Structural conversion (types, unknown and missing fields)
# ---------------------------------------------------------------------------


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _lookup(value: Any, rel_path: str) -> tuple[bool, Any]:
    """Follow a msgspec-relative path like ``[1].x`` inside ``value``."""
    for part in rel_path.replace("[", ".[").split("."):
        if not part:
            continue
        try:
            value = value[int(part[1:-1])] if part.startswith("[") else value[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return False, None
    return True, value


def _translate(exc: msgspec.ValidationError, path: str, value: Any) -> tuple[str, str]:
    """msgspec's ``Expected `int`, got `str` - at `$[1]``` -> (``path[1]``, problem)."""
    message, _, loc = str(exc).partition(" - at `")
    rel = loc.rstrip("`")[1:] if loc else ""
    problem = message[:1].lower() + message[1:]
    found, bad = _lookup(value, rel)
    if found:
        problem += f" (value: {bad!r})"
    return path + rel, problem


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    return tp if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else None


def _convert_value(value: Any, tp: Any, path: str, report: Report) -> tuple[bool, Any]:
    """Convert one field value; nested Structs, lists of Structs and dicts per item."""
    nested = _struct_type(tp)
    if nested is not None:
        obj = convert_struct(value, nested, path, report)
        return obj is not None, obj
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and _struct_type(args[0]) is not None:
        if not isinstance(value, list):
            report(path, f"expected a list, got {_kind(value)}")
            return False, None
        items = [convert_struct(v, args[0], f"{path}[{i}]", report) for i, v in enumerate(value)]
        return all(i is not None for i in items), items
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        # Per item, so the error names the key (msgspec would say ``[...]``).
        ok, out = True, {}
        for key, item in value.items():
            k_ok, k = _convert_value(key, args[0], f"{path}.{key}", report)
            v_ok, v = _convert_value(item, args[1], f"{path}.{key}", report)
            ok, out[k] = ok and k_ok and v_ok, v
        return ok, out
    try:
        return True, msgspec.convert(value, tp)
    except msgspec.ValidationError as exc:
        report(*_translate(exc, path, value))
        return False, None


def convert_struct(data: Any, cls: type[msgspec.Struct], path: str, report: Report) -> Any | None:
    """Build ``cls`` from a YAML mapping field by field, reporting every bad field.

    ``msgspec.convert`` stops at the first error; converting each field on its
    own (with its annotated type, constraints included) finds all of them. A
    ``null`` for an optional field means "use the default" (``runtime:`` with
    everything commented out is common in YAML). Fields listed in the class's
    ``_not_from_yaml`` are set by the loader and count as unknown here.
    """
    if not isinstance(data, dict):
        report(path, f"expected a mapping, got {_kind(data)}")
        return None
    excluded = getattr(cls, "_not_from_yaml", frozenset())
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls) if f.name not in excluded}
    ok = True
    for key in data:
        if key not in fields:
            report(f"{path}.{key}" if path else str(key), f"unknown field; expected one of: {', '.join(fields)}")
            ok = False
    kwargs: dict[str, Any] = {}
    for name, info in fields.items():
        sub = f"{path}.{name}" if path else name
        if data.get(name) is None and not info.required:
            continue
        if name not in data:
            report(sub, "missing required field")
            ok = False
            continue
        field_ok, kwargs[info.name] = _convert_value(data[name], info.type, sub, report)
        ok = ok and field_ok
    return cls(**kwargs) if ok else None


# ---------------------------------------------------------------------------
# Semantic checks (values, references, graph shape)
# ---------------------------------------------------------------------------


def check_dotted(path: Any, what: str, field_path: str, report: Report) -> None:
    """Import a ``pkg.mod:attr`` now, so a typo fails here and not in a stage process."""
    try:
        obj = resolve_dotted(path, what)
    except ValueError as exc:
        report(field_path, str(exc))
        return
    if not callable(obj):
        report(field_path, f"{what} {path!r} is not callable (got {_kind(obj)})")


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
    ignored here. Each cycle is reported once, starting from its first-visited stage.
    """
    consumers: dict[int, list[int]] = {sid: [] for sid in sources}
    for dst, srcs in sources.items():
        for src in srcs:
            if src in consumers and src != dst:
                consumers[src].append(dst)
    state: dict[int, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[int] = []
    cycles: list[list[int]] = []
    found: set[frozenset[int]] = set()

    def visit(node: int) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in consumers[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                if frozenset(cycle) not in found:
                    found.add(frozenset(cycle))
                    cycles.append(cycle)
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
