"""SIGTERM/SIGINT for programs that run a pipeline: unwind, so every stage is shut down.

Python's default SIGTERM ends the process at once: no ``finally``, no
``async with``, no atexit. The stages still die (they watch the client with
PDEATHSIG and free their own shared memory), but the client's socket
directories stay until the next client starts. Turning the signal into
cancellation of the main task lets ``async with MultiStageEngineClient``
run ``shutdown_async`` as on any other exit. A library must not take the
process's signals on its own, so programs opt in (the ``omni-engine``
commands do).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def cancel_on_signals(task: asyncio.Task | None = None,
                      signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
    """On the first of ``signals``, cancel ``task`` (default: the current one).

    Only the first signal cancels: a second one (an impatient supervisor, a
    repeated Ctrl-C) must not interrupt the shutdown that the first started.
    """
    task = task or asyncio.current_task()
    if task is None:
        raise RuntimeError("cancel_on_signals needs a task: call it from a coroutine or pass one")
    loop = asyncio.get_running_loop()
    signals = tuple(signals)

    def on_signal() -> None:
        for sig in signals:
            loop.add_signal_handler(sig, lambda: None)  # ignore from now on; shutdown is under way
        task.cancel()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
