"""Where a synchronous call stands relative to the event loop that owns an object.

vLLM's ``AsyncLLM.shutdown()`` is synchronous and works from anywhere: a
coroutine or a signal handler on the loop's thread, another thread, or after
the loop stopped or closed. Our clients own sockets, tasks and futures of one
loop, so a synchronous shutdown first asks where it is (``loop_context``):
on another thread it hands the work to the running loop; otherwise it does
the work itself, without awaiting (``cancel_now`` for the tasks).
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import Iterable


class LoopContext(enum.Enum):
    # On the loop's thread while it runs (a coroutine, a callback, a signal handler): nothing may block on it.
    ON_LOOP = "on_loop"
    # The loop runs in another thread: work on its objects goes through it.
    OTHER_THREAD = "other_thread"
    # No loop, or it stopped or closed: nothing runs there any more; its objects are ours to close.
    NOT_RUNNING = "not_running"


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None (``asyncio.get_running_loop`` raises)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def loop_context(loop: asyncio.AbstractEventLoop | None) -> LoopContext:
    if loop is None or loop.is_closed() or not loop.is_running():
        return LoopContext.NOT_RUNNING
    return LoopContext.ON_LOOP if running_loop() is loop else LoopContext.OTHER_THREAD


def cancel_now(tasks: Iterable[asyncio.Future | None]) -> None:
    """Cancel ``tasks`` without waiting. Where their loop does not run, they can never finish:
    they are also kept from warning "Task was destroyed but it is pending!" when collected."""
    for task in tasks:
        if task is None or task.done():
            continue
        loop = task.get_loop()
        idle = loop_context(loop) is LoopContext.NOT_RUNNING
        closed = loop.is_closed()
        if not closed:  # (a closed loop refuses the wake-up a cancel schedules)
            task.cancel()
        if idle:
            task._log_destroy_pending = False  # asyncio's own switch (gather uses it too)


# As the package's modules name their code files (not resolved: a symlinked install keeps its path).
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def own_tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task]:
    """The pending tasks of ``loop`` running omni_engine's own code (not the caller's)."""
    tasks = []
    for task in asyncio.all_tasks(loop):
        code = getattr(task.get_coro(), "cr_code", None)
        if code is not None and code.co_filename.startswith(_PACKAGE_DIR):
            tasks.append(task)
    return tasks
