"""The first code a stage process runs, whatever its transport.

Started by exec (``stage_process``): the client writes ``sys.path`` and then
``(spec, main)`` (pickled) into a pipe the process inherits. (The
legacy architecture's stages are spawned by ``multiprocessing`` instead and
call ``run_stage_process`` directly.) Kept free of heavy imports (no vLLM,
torch or numpy): until the spec is applied only this module and
``stage_spec`` are loaded, so the stage's environment is in place before the
stage's engine module (and vLLM with it) is imported. The serving code is
named by dotted path and imported after that.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from typing import Any, BinaryIO

from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.utils import die_with_parent, guard_process_group, resolve_dotted, start_resource_tracker_apart

ZMQ_STAGE_MAIN = "omni_engine.stage_engine.stage_core_proc:serve_zmq_stage"


def run_stage_process(spec: StageProcessSpec, main: str = ZMQ_STAGE_MAIN, **channels: Any) -> None:
    """Entry point of every stage process: set it up from ``spec``, then run ``main(spec, **channels)``."""
    enter_stage_process(spec)
    resolve_dotted(main, "stage process entry point")(spec, **channels)


def enter_stage_process(spec: StageProcessSpec) -> None:
    """Tie the process to its client, redirect its output, apply its environment.

    Not daemonic (vLLM starts children of its own), so the process ties its
    life to the client with the parent-death signal and its own process group,
    which the client kills as a whole if the stage dies, and a watchdog kills
    if the client cannot (``guard_process_group``).
    """
    die_with_parent()
    if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
        sys.exit(1)  # the client died before we could watch it
    os.setpgid(0, 0)
    guard_process_group()
    if spec.log_path:
        fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    # After the redirect: what the tracker says of semaphores a killed stage left goes to its log.
    start_resource_tracker_apart()
    os.environ.update(spec.process_environment())
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s stage{spec.stage_id} %(levelname)s %(name)s: %(message)s")


def main(pipe: BinaryIO) -> None:
    """Run the stage whose ``(spec, main)`` the client writes into ``pipe`` (after ``sys.path``,
    which the bootstrap has read and applied: see ``stage_process._BOOTSTRAP``)."""
    with pipe:
        spec, serve = pickle.load(pipe)
    run_stage_process(spec, serve)
