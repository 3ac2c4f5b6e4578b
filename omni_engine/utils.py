"""Small process and import helpers shared by stage processes and clients."""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def resolve_dotted(path: str, what: str = "object") -> Any:
    """Import ``pkg.module:attr`` or ``pkg.module.attr``; errors name the path."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a dotted path string, got {path!r}")
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not a dotted path like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


@functools.cache
def machine_host_id() -> str:
    """This process's shared-memory domain: the machine (its boot id) and the /dev/shm it sees.

    Two processes can exchange shared-memory handles only if they agree on it;
    a container with a /dev/shm of its own is another host in this sense.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "unknown-boot"
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = 0
    return f"{socket.gethostname()}/{boot_id}/{shm_dev}"


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    A stage process hosting vLLM cannot be daemonic (it has children), so this
    is what ties its life to the client's even after ``kill -9`` of the client.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - non-glibc
        logger.warning("cannot set the parent-death signal; orphaned stages are possible")


def tail_file(path: Path | None, max_lines: int = 40, max_bytes: int = 16384) -> str:
    """The last lines of a log file ('' if there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-max_lines:])


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"exited with code {exitcode}"
    return f"exited with code {exitcode}"


def call_quietly(fn: Callable[[], Any], what: str) -> None:
    """Run a cleanup step; a failure is logged, never raised (cleanup must go on)."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleanup keeps going
        logger.exception("error while %s", what)
