"""``StageQueue``: the ``multiprocessing.Queue`` a legacy stage talks over, with its pipe ends in reach.

A queue is a pipe plus a feeder thread. Each process uses one end of it, and
closing the other (inherited) end is what turns a dead peer into EOF/EPIPE
instead of a read or write that blocks forever; the client also watches the
read end's file descriptor to wake up without polling. ``multiprocessing``
keeps those ends private, so this subclass names the operations.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues


class StageQueue(multiprocessing.queues.Queue):
    """A spawn-context ``multiprocessing.Queue`` whose pipe ends can be closed and watched."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize, ctx=multiprocessing.get_context("spawn"))

    def close_read_end(self) -> None:
        """This process only puts: close its copy of the reading end."""
        self._reader.close()

    def close_write_end(self) -> None:
        """This process only gets: close its copy of the writing end."""
        self._writer.close()

    def reader_fileno(self) -> int:
        """The reading end's descriptor, readable when a message is waiting (for a loop reader)."""
        return self._reader.fileno()
