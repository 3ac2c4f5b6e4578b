"""Config-time checks of an llm stage's ``engine_args.logits_processors``.

vLLM would find a bad name only in the stage's engine core, after the model loaded
(and in the server's frontend, which loads the same classes to validate requests);
here it is one line naming the file, stage and field before anything starts.
"""

from __future__ import annotations

import importlib
from typing import Any

from omni_engine.config_validation import Report

FORM = "'pkg.module:Class'"


def check_logits_processors(value: Any, field_path: str, report: Report) -> None:
    """Each entry names an importable subclass of a vLLM ``LogitsProcessor`` (V1's or V2's)."""
    if value is None:
        return
    if not isinstance(value, list):
        report(field_path, f"expected a list of {FORM} names, got {type(value).__name__}")
        return
    for i, name in enumerate(value):
        if (problem := logits_processor_problem(name)) is not None:
            report(f"{field_path}[{i}]", problem)


def logits_processor_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a vLLM logits processor, or None."""
    if not isinstance(name, str) or name.count(":") != 1 or not all(name.split(":")):
        return f"{name!r} is not of the form {FORM} (vLLM's logits_processors form: one colon)"
    module_path, qualname = name.split(":")
    try:
        obj: Any = importlib.import_module(module_path)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to read
        return f"cannot import module {module_path!r} of logits processor {name!r}: {type(exc).__name__}: {exc}"
    for attr in qualname.split("."):
        if not hasattr(obj, attr):
            return f"module {module_path!r} has no {qualname!r} (logits processor {name!r})"
        obj = getattr(obj, attr)
    if not isinstance(obj, type) or not issubclass(obj, _processor_bases()):
        return (f"{name!r} is not a vLLM logits processor class (a subclass of "
                "vllm.v1.sample.logits_processor.LogitsProcessor, or of Model Runner V2's, e.g. "
                "omni_engine.logits.RequestKeyedLogitsProcessor, which is both)")
    return None


def _processor_bases() -> tuple[type, ...]:
    from vllm.v1.sample.logits_processor.interface import LogitsProcessor as V1LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

    return V1LogitsProcessor, V2LogitsProcessor
