"""The sync fence: no rollout request of any rank is in flight while rank 0 pushes weights.

The seed's strict order, per sync::

    every rank: close its RequestGate (waits for its in-flight rollout to finish; no new one starts)
    dist.barrier()                       every rank's prefetch is quiescent
    rank 0: push the weights, version v+1 (through the server's own fence as well)
    all-reduce of the push's outcome     the second barrier; a failed push fails every rank, none hangs
    every rank: reopen its gate at v+1   requests issued from here on are made by v+1

So a rollout carries the version its gate was opened at, and that is the version that
made it: the version cannot change while the request is in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


class GateStopped(RuntimeError):
    """The gate was stopped (the learner is shutting down): no more requests."""


class RequestGate:
    """Admits rollout requests while open; ``close`` waits until none is in flight."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._cond = threading.Condition()
        self._open = True
        self._stopped = False
        self._in_flight = 0

    @contextlib.contextmanager
    def request(self) -> Iterator[int]:
        """Hold the gate for one request; yields the weight version it is made with."""
        with self._cond:
            self._cond.wait_for(lambda: self._open or self._stopped)
            if self._stopped:
                raise GateStopped("the learner stopped: no more rollout requests")
            self._in_flight += 1
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def close(self) -> float:
        """Stop admitting and wait for the requests in flight; the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._in_flight == 0)
        return time.perf_counter() - start

    def open(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._open = True
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


class WeightSyncFence:
    """Runs one sync on every rank in the seed's order. ``push`` (rank 0 only) sends the weights as
    ``version``; the other ranks pass None."""

    def __init__(self, gate: RequestGate, push: Callable[[int], None] | None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.gate = gate
        self.push = push
        self.group = group
        self.windows: list[tuple[float, float, int]] = []  # (start, end, version) of each critical section

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def sync(self, version: int) -> dict[str, float]:
        """The whole fence; the seconds spent draining, pushing, and in all."""
        start = time.perf_counter()
        drained = self.gate.close()
        if self._distributed():
            dist.barrier(group=self.group)
        critical = time.time()
        failed, error = 0, None
        push_start = time.perf_counter()
        if self.push is not None:
            try:
                self.push(version)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                failed, error = 1, exc
        pushed = time.perf_counter() - push_start
        if self._distributed():
            status = torch.tensor([failed], dtype=torch.int64)
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.group)
            failed = int(status.item())
        self.windows.append((critical, time.time(), version))
        if failed:
            self.gate.open(self.gate.version)  # nothing changed on the server: keep rolling out on the old weights
            if error is not None:
                raise RuntimeError(f"weight sync to version {version} failed on this rank: {error}") from error
            raise RuntimeError(f"weight sync to version {version} failed on rank 0 (see its log)")
        self.gate.open(version)
        return {"drain_s": drained, "push_s": pushed, "sync_s": time.perf_counter() - start}
