"""Resident memory (and CPU time) of the processes of a pipeline, read from /proc (no psutil needed).

Processes are named ``client``, ``stage<N>`` and ``stage<N>/<pid>`` for what a
stage started itself (vLLM's EngineCore, when it runs as its own process).
"""

from __future__ import annotations

import os


def rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB; None if the process is gone (or a zombie, which has none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time ``pid`` has used, in seconds; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(parents.get(child, []))
    return sorted(found)


def pipeline_processes(stage_pids: dict[str, int]) -> dict[str, int]:
    """``client``, each stage and each stage's descendants -> pid."""
    procs = {"client": os.getpid()}
    for name, pid in stage_pids.items():
        procs[name] = pid
        for child in descendants(pid):
            procs[f"{name}/{child}"] = child
    return procs


def snapshot(procs: dict[str, int]) -> dict[str, int | None]:
    """RSS (KiB) of each named process now."""
    return {name: rss_kib(pid) for name, pid in procs.items()}


def cpu_snapshot(procs: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds used so far by each named process."""
    return {name: cpu_seconds(pid) for name, pid in procs.items()}


def growth(start: dict[str, int | None], end: dict[str, int | None]) -> dict[str, float | None]:
    """Per process, RSS growth from ``start`` to ``end`` in percent (None: not measured at both)."""
    return {name: (round(100.0 * (end[name] - kib) / kib, 2) if kib and end.get(name) else None)
            for name, kib in start.items()}
