"""Notice at once when vLLM's EngineCore process dies under an llm stage.

vLLM's own monitor thread marks its client dead, and the next ``generate`` or health check
raises ``EngineDeadError``; but a utility call already in flight (``update_weights``,
``collective_rpc``, ``pause_generation``) waits on a future nothing ever completes, and an idle
stage says nothing until someone asks. Measured in our suite: the kernel's OOM killer took an
EngineCore during a weight push and the push waited forever. The stage watches the process
sentinels itself, on its event loop (no thread, no polling), and ends with DEAD naming the
process and its exit: the client fails what waits on the stage and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def engine_core_processes(async_llm: Any) -> list[Any]:
    """The ``multiprocessing`` processes of ``async_llm``'s EngineCores ([] where vLLM runs the
    core in-process or on Ray, which has its own monitoring)."""
    resources = getattr(getattr(async_llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return [p for p in getattr(manager, "processes", None) or () if hasattr(p, "sentinel")]


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "ended"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (the kernel's OOM killer sends it when memory runs out)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"


class EngineCoreWatch:
    """Calls ``on_death(message)`` once if a watched process ends before ``close``."""

    def __init__(self, processes: list[Any], on_death: Callable[[str], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_death = on_death
        self._processes = list(processes)
        for process in self._processes:
            self._loop.add_reader(process.sentinel, self._exited, process)

    def _exited(self, process: Any) -> None:
        if not self._processes:
            return
        self.close()
        process.join(timeout=1.0)  # the sentinel fired: it has ended, reap it for its exit code
        # vLLM's own monitor thread reaps the same process object: when its waitpid wins, ours
        # finds no child and the exit code appears only once that thread has stored it (seen in CI:
        # "ended" instead of "was killed by SIGKILL"). Wait for it, briefly; this is the death path.
        deadline = time.monotonic() + 1.0
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        message = f"vLLM's EngineCore (pid {process.pid}) {describe_exit(process.exitcode)}"
        logger.error("%s", message)
        self._on_death(message)

    def close(self) -> None:
        """Stop watching (before the engine is shut down on purpose). Idempotent."""
        processes, self._processes = self._processes, []
        if self._loop.is_closed():
            return
        for process in processes:
            self._loop.remove_reader(process.sentinel)
