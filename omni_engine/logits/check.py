"""Config-time checks of an llm stage's ``engine_args.logits_processors``.

vLLM would find a bad name only in the stage's engine core, after the model loaded
(and in the server's frontend, which loads the same classes to validate requests);
here it is one line naming the file, stage and field before anything starts.
"""

from __future__ import annotations

import importlib
from typing import Any

from omni_engine.config.convert import Report

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


def check_mixing(stages: list[tuple[int, Any]], errors: Any) -> None:
    """Each ``mixing`` section: its stage is an llm stage, its theta stage an existing llm stage
    other than itself, its α method known and its ``alpha_value`` in [0, 1] where needed."""
    from omni_engine.logits.mixing_wiring import ALPHA_METHODS

    by_id = {stage.stage_id: stage for _, stage in stages}
    for i, stage in stages:
        mixing = stage.mixing
        if mixing is None:
            continue
        path, label = f"stage_args[{i}].mixing", f"stage {stage.stage_id}"

        def report(field: str, problem: str) -> None:
            errors.add(f"{path}.{field}" if field else path, problem, label)

        if stage.stage_type != "llm":
            report("", f"mixing applies to llm stages (this stage is {stage.stage_type!r})")
        theta = by_id.get(mixing.theta_stage)
        if theta is None:
            report("theta_stage", f"stage {mixing.theta_stage} does not exist (stage ids: {sorted(by_id)})")
        elif theta is stage:
            report("theta_stage", "a stage cannot mix in its own distribution; name another llm stage")
        elif theta.stage_type != "llm":
            report("theta_stage", f"stage {theta.stage_id} is a {theta.stage_type!r} stage; theta must be an llm stage")
        elif theta.final_output or theta.engine_input_source:
            report("theta_stage", f"stage {theta.stage_id} takes part in the request graph (final_output or "
                                  "engine_input_source); a theta stage only scores for its teacher")
        elif theta.runtime.transport != "ipc" or not theta.runtime.process:
            report("theta_stage", f"stage {theta.stage_id} must be a stage process on this host (transport: ipc)")
        elif (batch := _batch_size(stage)) is not None and (theta_batch := _batch_size(theta)) is not None \
                and theta_batch * theta.runtime.num_replicas < batch:
            report("theta_stage", f"stage {theta.stage_id} holds {theta_batch * theta.runtime.num_replicas} sessions "
                                  f"(max_batch_size x replicas), fewer than the {batch} requests this teacher decodes "
                                  "at once: every live request needs one")
        if mixing.alpha not in ALPHA_METHODS:
            report("alpha", f"unknown alpha method {mixing.alpha!r}; expected one of {list(ALPHA_METHODS)}")
        elif mixing.alpha == "fixed" and mixing.alpha_value is None:
            report("alpha_value", "missing; alpha: fixed needs a value in [0, 1]")
        if mixing.alpha_value is not None and not 0.0 <= mixing.alpha_value <= 1.0:
            report("alpha_value", f"{mixing.alpha_value} is outside [0, 1]")


def _batch_size(stage: Any) -> int | None:
    value = stage.runtime.max_batch_size or stage.engine_args.get("max_num_seqs")
    return int(value) if isinstance(value, int) else None
