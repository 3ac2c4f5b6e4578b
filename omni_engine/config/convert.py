"""YAML data -> ``msgspec.Struct``s, collecting every problem instead of raising.

A user fixing a config sees every mistake at once rather than one per run, and
before any stage process starts (a bad config must not cost a 25-second vLLM
start to find out about). The pipeline config, the RL and the sampler configs
all convert through here.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgspec

from omni_engine.utils import resolve_dotted

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


def check_dotted(path: Any, what: str, field_path: str, report: Report) -> None:
    """Import a ``pkg.mod:attr`` now, so a typo fails here and not in a stage process."""
    try:
        obj = resolve_dotted(path, what)
    except ValueError as exc:
        report(field_path, str(exc))
        return
    if not callable(obj):
        report(field_path, f"{what} {path!r} is not callable (got {_kind(obj)})")
