"""Named semaphores that dead processes left in ``/dev/shm`` (``sem.mp-*``), found and removed.

Python's ``multiprocessing`` (which vLLM uses to start its engine core) makes a
named POSIX semaphore for every lock, queue and event under the ``spawn``
method; its resource tracker unlinks them when their processes are gone. A
stage starts that tracker apart from its process group
(``utils.start_resource_tracker_apart``) so that a stage's end does not kill it;
but a tracker can still be killed with everything else (``kill -9`` of a whole
job, the OOM killer), and what it held stays: 32 bytes each, forever.

A semaphore is in use exactly while some process maps its file (``sem_open``
maps it; a child opening it by name is handed it by a parent that maps it), so
one that no process maps is garbage: the next client removes such files of its
own user, once they are old enough that a tracker that is still about to
unlink them has had its time.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

from omni_engine.connectors.shm import SHM_DIR

logger = logging.getLogger(__name__)

SEMAPHORE_GLOB = "sem.mp-*"
# A file younger than this is left alone: its tracker may be about to unlink it.
ORPHAN_MIN_AGE_S = 30.0


def mapped_inodes(directory: Path = SHM_DIR) -> set[int]:
    """Inodes of the files in ``directory``'s file system that some process (that this user may
    inspect) has mapped. Processes of other users cannot open this user's semaphores (mode 0600)."""
    dev = os.stat(directory).st_dev
    tag = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    inodes: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except (OSError, ValueError):  # gone, or another user's
            continue
        for line in text.splitlines():
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[3] == tag and fields[4] != "0":
                inodes.add(int(fields[4]))
    return inodes


def orphan_semaphores(min_age_s: float = ORPHAN_MIN_AGE_S, directory: Path = SHM_DIR) -> list[Path]:
    """This user's ``sem.mp-*`` files in ``directory`` that no process maps, at least ``min_age_s`` old."""
    now, uid = time.time(), os.getuid()
    candidates = []
    for path in directory.glob(SEMAPHORE_GLOB):
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid and now - info.st_mtime >= min_age_s:
            candidates.append((path, info.st_ino))
    if not candidates:
        return []
    mapped = mapped_inodes(directory)
    return [path for path, inode in candidates if inode not in mapped]


def remove_orphan_semaphores(min_age_s: float = ORPHAN_MIN_AGE_S, directory: Path = SHM_DIR) -> list[str]:
    """Unlink what ``orphan_semaphores`` finds; returns the names removed."""
    removed = []
    for path in orphan_semaphores(min_age_s, directory):
        try:
            path.unlink()
        except FileNotFoundError:  # its tracker was first
            continue
        except OSError as exc:
            logger.debug("cannot remove %s: %s", path, exc)
            continue
        removed.append(path.name)
    if removed:
        logger.info("removed %d semaphores (/dev/shm/sem.mp-*) that dead processes left", len(removed))
    return removed
