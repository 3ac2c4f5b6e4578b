"""How a mixing teacher and its theta stage find each other (no vLLM import: config time).

The theta stage's engine binds a PULL socket per replica where teachers send each step's
batch; the teacher's processor (in the teacher's vLLM engine core) gets the addresses
and the α settings through vLLM's ``additional_config``; theta's capture processor
answers the teacher directly.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

ALPHA_METHODS = ("fixed", "kl_symmetry")
MIXING_PROCESSOR = "omni_engine.logits.mixing:ThetaMixingProcessor"
CAPTURE_PROCESSOR = "omni_engine.logits.theta:ThetaCaptureProcessor"
# additional_config key of the teacher's settings; engine_args key of theta's (popped by the
# llm stage engine before vLLM sees them).
MIXING_KEY = "omni_mixing"
THETA_KEY = "omni_theta"


def theta_address(run: str, stage_id: int, replica: int) -> str:
    return f"ipc://{tempfile.gettempdir()}/omni-{os.getpid()}-theta-{run}-s{stage_id}-r{replica}"


def wire_mixing(stages: list[Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Engine args to add, by (stage id, replica), for every teacher and theta stage."""
    run = uuid.uuid4().hex[:8]
    by_id = {stage.stage_id: stage for stage in stages}
    extra: dict[tuple[int, int], dict[str, Any]] = {}
    for stage in stages:
        mixing = stage.mixing
        if mixing is None:
            continue
        theta = by_id[mixing.theta_stage]
        addresses = [theta_address(run, theta.stage_id, r) for r in range(theta.runtime.num_replicas)]
        for r, address in enumerate(addresses):
            processors = [*(theta.engine_args.get("logits_processors") or ()), CAPTURE_PROCESSOR]
            # Without chunked prefill a chunk is never split over steps, so every captured
            # row is the last position of the whole sequence.
            extra[(theta.stage_id, r)] = {THETA_KEY: {"address": address, "chat_template": mixing.theta_chat_template},
                                          "logits_processors": processors, "enable_chunked_prefill": False}
        # Relative paths are the command's (the engine core may run elsewhere).
        settings = {"theta": addresses, "alpha": mixing.alpha, "alpha_value": mixing.alpha_value,
                    "alpha_history": _absolute(mixing.alpha_history), "timeout_s": mixing.theta_timeout_s,
                    "record_rows": _absolute(mixing.record_rows)}
        for r in range(stage.runtime.num_replicas):
            additional = dict(stage.engine_args.get("additional_config") or {})
            additional[MIXING_KEY] = settings
            extra[(stage.stage_id, r)] = {"additional_config": additional}
    return extra


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None
