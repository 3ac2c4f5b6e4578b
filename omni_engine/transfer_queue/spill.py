"""``SpillFile``: where trajectories of incomplete groups wait when memory runs short.

Scratch space, not a durable copy (the write-ahead log is that): one
append-only file, read back with ``pread`` when a group is consumed, and cut
back to zero bytes whenever nothing in it is live any more. The file is
unlinked as soon as it is opened, so it cannot outlive the process.
"""

from __future__ import annotations

import os
import tempfile


class SpillFile:
    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        fd, path = tempfile.mkstemp(prefix="tq-spill-", dir=directory)
        os.unlink(path)
        self._fd = fd
        self.file_bytes = 0  # bytes in the file, live or not
        self.live_bytes = 0  # bytes of trajectories still spilled

    def append(self, payload: bytes) -> int:
        """Write ``payload`` at the end; returns its offset."""
        offset = self.file_bytes
        view = memoryview(payload)
        while view:
            view = view[os.pwrite(self._fd, view, offset + len(payload) - len(view)):]
        self.file_bytes += len(payload)
        self.live_bytes += len(payload)
        return offset

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise OSError(f"spill file: read {len(data)} of {size} bytes at offset {offset}")
        return data

    def free(self, size: int) -> None:
        """``size`` spilled bytes are no longer needed (read back or discarded)."""
        self.live_bytes -= size
        if self.live_bytes == 0 and self.file_bytes:
            self.clear()

    def clear(self) -> None:
        os.ftruncate(self._fd, 0)
        self.file_bytes = self.live_bytes = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
