"""``kill -USR1 <pid>`` of a stress script prints where every asyncio task waits (to find a hang)."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
import sys


def install_task_dump() -> None:
    """On SIGUSR1: every thread's stack (faulthandler) and every task's coroutine stack, on stderr."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)


def _dump_tasks() -> None:
    faulthandler.dump_traceback(all_threads=True)
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio task(s) ---", file=out)
    for task in tasks:
        task.print_stack(limit=12, file=out)
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()
