"""How a mixing teacher and its theta stage find each other (no vLLM import: config time).

The theta stage's engine binds a PULL socket per replica where teachers send each step's
batch; the teacher's processor (in the teacher's vLLM engine core) gets the addresses
and the α settings through vLLM's ``additional_config``; theta's capture processor
answers the teacher directly.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from omni_engine.weights import WORKER_EXTENSION

ALPHA_METHODS = ("fixed", "kl_symmetry")
MIXING_PROCESSOR = "omni_engine.logits.mixing:ThetaMixingProcessor"
CAPTURE_PROCESSOR = "omni_engine.logits.theta:ThetaCaptureProcessor"
# additional_config key of the teacher's settings; engine_args key of theta's (popped by the
# llm stage engine before vLLM sees them).
MIXING_KEY = "omni_mixing"
THETA_KEY = "omni_theta"
# Environment defaults of a mixing teacher and its theta (a stage's own ``env`` wins). The
# two engine cores take turns on the same CPU cores at every step. torch's OpenMP (libgomp)
# workers spin ~9 ms after each parallel region by default (GOMP_SPINCOUNT 300000 here), so
# after its turn one engine core's workers held a core the other's forward pass needed;
# 30000 (~1.5 ms) still bridges the gaps between a forward pass's ops. Measured with
# benchmarks/bench_mixing.py: step / (teacher + theta) 1.27x -> 1.07x at concurrency 1,
# 1.25x -> 1.14x at 8. (Not monotonic: 100000 measured 4x slower; see benchmarks/README.md.)
MIXING_STAGE_ENV = {"GOMP_SPINCOUNT": "30000"}


def socket_dir(stage_id: int) -> str:
    """A private (0700) directory for one mixing pair's ipc sockets: only this user can
    send theta a batch or a teacher a row. Removed when this process exits; a directory of
    a process killed with -9 matches the stale-runtime-directory sweep (``omni-<pid>-...-s...``)."""
    path = tempfile.mkdtemp(prefix=f"omni-{os.getpid()}-mix-s{stage_id}-")
    atexit.register(shutil.rmtree, path, True)
    return path


def wire_mixing(stages: list[Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Engine args to add, by (stage id, replica), for every teacher and theta stage."""
    by_id = {stage.stage_id: stage for stage in stages}
    extra: dict[tuple[int, int], dict[str, Any]] = {}
    for stage in stages:
        mixing = stage.mixing
        if mixing is None:
            continue
        theta = by_id[mixing.theta_stage]
        sockets = socket_dir(stage.stage_id)
        addresses = [f"ipc://{sockets}/theta-r{r}" for r in range(theta.runtime.num_replicas)]
        for r, address in enumerate(addresses):
            processors = [*(theta.engine_args.get("logits_processors") or ()), CAPTURE_PROCESSOR]
            # Without chunked prefill a chunk is never split over steps, so every captured
            # row is the last position of the whole sequence.
            extra[(theta.stage_id, r)] = {THETA_KEY: {"address": address, "chat_template": mixing.theta_chat_template},
                                          "logits_processors": processors, "enable_chunked_prefill": False}
        # Relative paths are the command's (the engine core may run elsewhere).
        settings = {"theta": addresses, "socket_dir": sockets, "alpha": mixing.alpha, "alpha_value": mixing.alpha_value,
                    "alpha_history": _absolute(mixing.alpha_history), "timeout_s": mixing.theta_timeout_s,
                    "record_rows": _absolute(mixing.record_rows), "overlap": mixing.overlap}
        for r in range(stage.runtime.num_replicas):
            additional = dict(stage.engine_args.get("additional_config") or {})
            additional[MIXING_KEY] = settings
            # The worker extension releases held requests at shutdown (their α lines).
            extra[(stage.stage_id, r)] = {"additional_config": additional, "worker_extension_cls": WORKER_EXTENSION}
    return extra


def mixing_stage_env(stages: list[Any]) -> dict[int, dict[str, str]]:
    """Environment defaults, by stage id, of every mixing teacher and its theta stage."""
    env: dict[int, dict[str, str]] = {}
    for stage in stages:
        if stage.mixing is not None:
            env[stage.stage_id] = env[stage.mixing.theta_stage] = dict(MIXING_STAGE_ENV)
    return env


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None
