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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.utils import (
    die_with_parent,
    guard_process_group,
    resolve_dotted,
    set_process_name,
    start_resource_tracker_apart,
)

if TYPE_CHECKING:
    from omni_engine.stage_engine.stage_core import StageEngineCore

logger = logging.getLogger(__name__)

ZMQ_STAGE_MAIN = "omni_engine.stage_engine.stage_entry:serve_zmq_stage"
SPARE_PRELOAD = "omni_engine.engines:preload_stage_engine"


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
    set_process_name(stage_process_name(spec))
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
    pin_to_cpus(spec)
    set_niceness(spec)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s stage{spec.stage_id} %(levelname)s %(name)s: %(message)s")


def pin_to_cpus(spec: StageProcessSpec) -> None:
    """Run the process (and all it starts later: vLLM's EngineCore, its threads) on ``spec.cpus``,
    with as many intra-op threads as cores unless the stage's environment says otherwise.

    First thing, before any library starts a thread pool: OpenMP and onnxruntime size theirs once.
    Engines that size their own pool (a Piper voice) read their cores back (``utils.pinned_cores``).
    """
    if spec.cpus is None:
        return
    try:
        os.sched_setaffinity(0, spec.cpus)
    except OSError as exc:
        raise SystemExit(f"stage {spec.stage_id}: runtime.cpus {list(spec.cpus)}: cannot run on those cores "
                         f"({exc.strerror}; this machine's cores are {sorted(os.sched_getaffinity(0))})") from None
    # The call moves only this thread; a warm spare taken to serve has threads of its own already
    # (its imports'), which would stay where the spare ran. A thread that ends meanwhile is gone.
    for thread_id in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread_id), spec.cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass
    if spec.env.get("OMP_NUM_THREADS") is None:  # a spare taken for a share of another size resizes too
        os.environ["OMP_NUM_THREADS"] = str(len(spec.cpus))


def set_niceness(spec: StageProcessSpec) -> None:
    """Run the process at ``spec.nice``: every thread it has (Linux's niceness is per thread; a warm
    spare taken to serve has threads already), and so every thread and process it starts later."""
    if not spec.nice:
        return
    for thread_id in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(thread_id), spec.nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
        except OSError as exc:
            raise SystemExit(f"stage {spec.stage_id}: runtime.nice {spec.nice}: cannot set it ({exc.strerror}; "
                             "a negative niceness needs the privilege to raise priority, CAP_SYS_NICE)") from None


def stage_process_name(spec: StageProcessSpec) -> str:
    """What ``top``, ``ps -o comm`` and ``pgrep`` call a stage process (as vLLM's
    ``VLLM::EngineCore``): ``omni-stage1``."""
    return f"omni-stage{spec.stage_id}"


def spare_process_name(spec: StageProcessSpec) -> str:
    """A warm spare's name until it is taken (``comm`` keeps 15 bytes): ``omni-spare1``."""
    return f"omni-spare{spec.stage_id}"


def main(pipe: BinaryIO) -> None:
    """Run the stage whose ``(spec, main)`` the client writes into ``pipe`` (after ``sys.path``,
    which the bootstrap has read and applied: see ``stage_process._BOOTSTRAP``). A warm spare
    (``spec.spare``) reads the spec it serves from the same pipe once it is taken."""
    with pipe:
        spec, serve = pickle.load(pipe)
        if spec.spare:
            enter_stage_process(spec)
            taken = wait_until_taken(spec, pipe)
    if not spec.spare:
        run_stage_process(spec, serve)
    elif taken is not None:  # None: not wanted any more
        resolve_dotted(serve, "stage process entry point")(taken)


def wait_until_taken(spec: StageProcessSpec, pipe: BinaryIO) -> StageProcessSpec | None:
    """A warm spare: import what the stage's engine needs, then wait for the spec of the replica
    this process is to become (None: the pipe closed, no longer wanted)."""
    set_process_name(spare_process_name(spec))
    started = time.monotonic()
    resolve_dotted(SPARE_PRELOAD, "warm spare preload")(spec)
    logger.info("warm spare of stage %s ready in %.1f s; waiting to be taken", spec.stage_id,
                time.monotonic() - started)
    try:
        taken: StageProcessSpec = pickle.load(pipe)
    except EOFError:
        logger.info("warm spare of stage %s not needed any more; exiting", spec.stage_id)
        return None
    # The replica's own settings (its devices above all), before its engine touches a device.
    os.environ.update(taken.process_environment())
    pin_to_cpus(taken)
    set_niceness(taken)
    set_process_name(stage_process_name(taken))
    logger.info("warm spare taken: serving stage %s", taken.stage_id)
    return taken


def serve_stage(stage_id: int, make_core: Callable[[], StageEngineCore]) -> None:
    """Build the stage (``make_core()``), serve it, exit with its exit code; failures are logged."""
    exit_code = 1
    try:
        exit_code = make_core().run()
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - logged for the client to show
        logger.exception("stage %d failed", stage_id)
    finally:
        logging.shutdown()
    sys.exit(exit_code)


def serve_zmq_stage(spec: StageProcessSpec) -> None:
    """A ZMQ stage process's serving function (after ``enter_stage_process``)."""
    from omni_engine.engines import build_stage_engine
    from omni_engine.stage_engine.stage_core_proc import StageEngineCoreProc
    from omni_engine.stage_engine.stage_core_threads import ThreadedStageEngineCoreProc

    transport = spec.transport
    if transport is None:
        raise ValueError(f"stage {spec.stage_id}: a ZMQ stage process needs spec.transport (its addresses)")
    core_class = ThreadedStageEngineCoreProc if spec.io == "threads" else StageEngineCoreProc
    if spec.stage_type == "llm":
        from omni_engine.engines.warm_engine_core import prepare_engine_core_start

        # Before build_stage_engine imports vLLM: a forkserver's import overlaps it.
        prepare_engine_core_start(spec.engine_core_start)

    def make_core() -> StageEngineCoreProc:
        engine = build_stage_engine(spec)
        return core_class(spec.stage_id, engine, transport.input_address, transport.output_address,
                            transport.shm_prefix, spec.curve, spec.connectors, host_id=spec.host_id,
                            heartbeat_interval=spec.heartbeat_interval)

    serve_stage(spec.stage_id, make_core)
