"""``StageReplicaSet``: N replicas of one stage behind the interface of one stage client.

The orchestrator sees one stage. The set picks a replica per request (fewest
requests in flight relative to the batch size, ties rotated; or round-robin),
keeps the sub-requests of one request on one replica when the stage holds
per-request state (``affinity: request``), and merges the replicas' outputs
into one stream: each replica's client hands its batches to the set
(``BaseStageClient.sink``), so merging costs no task and no extra hop.

A replica that dies is evicted at once. What it ran that had produced no
output yet is resubmitted to a live replica (``retry: before_first_output``);
the rest fails with a ``StageDeadError`` naming stage and replica, delivered
in the output stream like a request's error, so only those requests fail.
The evicted client is shut down (its sockets and CURVE authenticator go, so a
zombie process cannot inject outputs). The set is dead only while no replica
lives; the ``StageSupervisor`` restarts replicas one by one (``readmit``).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from omni_engine.errors import StageDeadError
from omni_engine.loop_context import cancel_now
from omni_engine.outputs import OmniRequestOutput
from omni_engine.stage_engine.base_client import BaseStageClient
from omni_engine.stage_engine.base_client import StageOutputQueue
from omni_engine.stage_engine.stage_client import ReplicaStatus, StageItem

logger = logging.getLogger(__name__)


class LoadBalance(enum.Enum):
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class Affinity(enum.Enum):
    NONE = "none"  # sub-requests spread like requests
    REQUEST = "request"  # sub-requests of one request stay on its replica


class RetryPolicy(enum.Enum):
    BEFORE_FIRST_OUTPUT = "before_first_output"
    NEVER = "never"


@dataclass(slots=True)
class _Submission:
    """What resubmitting a request takes (kept until its first output)."""

    prompt: Any
    sampling_params: Any
    end_on_finish: bool
    trace: dict[str, str] | None = None
    deadline: float | None = None
    stream_states: bool = False
    lora_request: Any = None


@dataclass(slots=True)
class _Resubmission:
    """A resubmission under way; an abort arriving meanwhile is sent after its GENERATE."""

    replica: int
    abort: bool | None = None  # None: not aborted; else keep_final of the abort


class StageReplicaSet:
    """A ``StageClient`` over N replicas of one stage (each a ``BaseStageClient``)."""

    def __init__(self, stage_id: int, replicas: Sequence[BaseStageClient], *,
                 load_balance: LoadBalance | str | None = None,
                 affinity: Affinity | str | None = None,
                 retry: RetryPolicy | str | None = None,
                 capacity: int = 1) -> None:
        """``capacity``: a replica's batch size (load is requests in flight over it). A policy
        left None is the default: least-loaded, no affinity, retry before the first output."""
        if not replicas:
            raise ValueError(f"stage {stage_id}: a replica set needs at least one replica")
        self.stage_id = stage_id
        self.load_balance = LoadBalance(load_balance or LoadBalance.LEAST_LOADED)
        self.affinity = Affinity(affinity or Affinity.NONE)
        self.retry = RetryPolicy(retry or RetryPolicy.BEFORE_FIRST_OUTPUT)
        self.capacity = max(1, capacity)
        self.replicas: list[BaseStageClient] = list(replicas)
        self.dead_error: StageDeadError | None = None
        # Told when a replica dies unexpectedly (the supervisor restarts it).
        self.on_replica_dead: Callable[[int, StageDeadError], None] | None = None
        self.submitted = [0] * len(self.replicas)  # per replica, resubmissions included
        self.resubmitted = 0
        self._owner: dict[str, int] = {}  # request id -> replica running (or holding) it
        self._retryable: dict[str, _Submission] = {}  # no output yet
        self._manual_end: set[str] = set()  # end_on_finish=False: owned until end_request
        self._finished: set[str] = set()  # finished, still held until end_request
        self._resubmitting: dict[str, _Resubmission] = {}
        self._group_of: dict[str, str] = {}
        self._group_replica: dict[str, list[int]] = {}  # group -> [replica, requests of it here]
        self._next = 0  # where the rotation starts
        self._outputs = StageOutputQueue()  # every replica's batches, merged
        self._tasks: set[asyncio.Task] = set()
        self._bytes_gone = [0, 0]  # sent, received by replicas replaced since
        self._stopped = False
        self._evictions: set[asyncio.Task] = set()  # shutdowns of dead replicas' clients
        for index, client in enumerate(self.replicas):
            self._attach(index, client)

    def _attach(self, index: int, client: BaseStageClient) -> None:
        client.sink = functools.partial(self._on_items, index)
        client.on_dead = functools.partial(self._on_replica_dead, index)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every replica (in parallel); if one fails, stop them all and raise its error."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
            raise errors[0]

    def readmit(self, index: int, client: BaseStageClient) -> None:
        """A started client takes the place of dead replica ``index`` and serves from now on."""
        old = self.replicas[index]
        self._bytes_gone[0] += old.bytes_sent
        self._bytes_gone[1] += old.bytes_received
        self.replicas[index] = client
        self._attach(index, client)
        if not self._stopped:
            self.dead_error = None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica and free what the set holds. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        # Evictions under way finish (they free the dead replicas' sockets and files); retries stop.
        evictions = list(self._evictions)
        for task in self._tasks - self._evictions:
            task.cancel()
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas), *self._tasks, return_exceptions=True)
        await asyncio.gather(*evictions, return_exceptions=True)
        self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} client is shut down"))

    def ask_stop_now(self) -> bool:
        """Every replica is asked to exit (see ``BaseStageClient.ask_stop_now``)."""
        if self._stopped:
            return False
        self._stopped = True
        for replica in self.replicas:
            replica.ask_stop_now()
        return True

    def finish_shutdown_now(self, timeout: float) -> None:
        cancel_now(list(self._tasks))
        deadline = time.monotonic() + timeout  # one grace period for all: they were asked together
        # Every replica, evicted ones too (their eviction task was just cancelled): a replica not
        # asked gets no grace, and what its client holds is freed either way.
        for replica in self.replicas:
            replica.finish_shutdown_now(max(0.0, deadline - time.monotonic()))
        error = StageDeadError(self.stage_id, f"stage {self.stage_id} client is shut down")
        try:
            self._set_dead(error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            self.dead_error = error

    # -------------------------------------------------------------- status
    @property
    def live(self) -> list[int]:
        """Indices of the replicas that serve now."""
        return [i for i, r in enumerate(self.replicas) if not r.is_dead and r.ready is not None]

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def ready(self) -> Any:
        """The first live replica's READY (its engine info stands for the stage)."""
        live = self.live
        return self.replicas[live[0] if live else 0].ready

    @property
    def process(self) -> Any:
        return self.replicas[0].process

    @property
    def bytes_sent(self) -> int:
        return self._bytes_gone[0] + sum(r.bytes_sent for r in self.replicas)

    @property
    def bytes_received(self) -> int:
        return self._bytes_gone[1] + sum(r.bytes_received for r in self.replicas)

    def replica_of(self, request_id: str) -> int | None:
        """The replica running (or holding) ``request_id``; None once it is forgotten."""
        return self._owner.get(request_id)

    def replica_status(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(not r.is_dead, r.num_unfinished_requests(), self.submitted[i],
                              r.ready.pid if r.ready is not None else None,
                              r.ready.host_id if r.ready is not None else None)
                for i, r in enumerate(self.replicas)]

    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests() for r in self.replicas)

    def state_counts(self) -> dict[str, int]:
        """As ``BaseStageClient.state_counts``, over every replica and the merged queue."""
        counts = {"in_flight": 0, "held": 0, "queued": 0}
        for replica in self.replicas:
            for key, value in replica.state_counts().items():
                counts[key] += value
        counts["queued"] += len(self._outputs)
        return counts

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if not self.live:
            raise RuntimeError(f"stage {self.stage_id} client is not started")

    # ------------------------------------------------------------- requests
    def _pick(self, group: str | None) -> int:
        if group is not None and self.affinity is Affinity.REQUEST:
            bound = self._group_replica.get(group)
            if bound is not None and not self.replicas[bound[0]].is_dead:
                return bound[0]
        live = self.live
        if not live:
            raise self.dead_error or StageDeadError(self.stage_id, f"stage {self.stage_id}: no replica is alive")
        n = len(self.replicas)
        start = self._next
        self._next = (start + 1) % n
        rotated = sorted(live, key=lambda i: (i - start) % n)
        if self.load_balance is LoadBalance.ROUND_ROBIN:
            return rotated[0]
        return min(rotated, key=lambda i: self.replicas[i].num_unfinished_requests() / self.capacity)

    def _bind(self, request_id: str, index: int) -> None:
        self._owner[request_id] = index
        self.submitted[index] += 1
        group = self._group_of.get(request_id)
        if group is not None:
            self._group_replica[group][0] = index

    async def submit_request(self, request_id: str, prompt: Any, sampling_params: Any = None, *,
                             end_on_finish: bool = True, group: str | None = None,
                             trace: dict[str, str] | None = None, deadline: float | None = None,
                             input_stream: bool = False, stream_states: bool = False,
                             lora_request: Any = None) -> None:
        """Send a GENERATE to the replica chosen for it (see ``BaseStageClient.submit_request``).
        A request whose input comes in parts is not resubmitted: another replica would lack them."""
        self._check_alive()
        if request_id in self._owner:
            raise ValueError(f"stage {self.stage_id}: request id {request_id!r} is already in flight")
        index = self._pick(group)
        if group is not None:
            self._group_of[request_id] = group
            self._group_replica.setdefault(group, [index, 0])[1] += 1
        self._bind(request_id, index)
        if not end_on_finish:
            self._manual_end.add(request_id)
        if self.retry is RetryPolicy.BEFORE_FIRST_OUTPUT and not input_stream:
            self._retryable[request_id] = _Submission(prompt, sampling_params, end_on_finish, trace, deadline,
                                                          stream_states, lora_request)
        try:
            await self.replicas[index].submit_request(request_id, prompt, sampling_params,
                                                      end_on_finish=end_on_finish, trace=trace, deadline=deadline,
                                                      input_stream=input_stream, stream_states=stream_states,
                                                      lora_request=lora_request)
        except BaseException:
            if self._owner.get(request_id) == index:  # not taken over by a retry (the replica died sending)
                self._forget(request_id)
                raise

    async def extend_request(self, request_id: str, prompt: Any, *, last: bool) -> bool:
        """Append to the input of the request on the replica running it (never resubmitted)."""
        index = self._owner.get(request_id)
        if index is None or self.replicas[index].is_dead:
            return False
        return await self.replicas[index].extend_request(request_id, prompt, last=last)

    async def abort_request(self, request_ids: str | Sequence[str], *, keep_final: bool = False) -> None:
        """Abort on the replicas running them (see ``BaseStageClient.abort_request``)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            index = self._owner.get(rid)
            if index is None:
                continue
            resubmission = self._resubmitting.get(rid)
            if resubmission is not None:
                resubmission.abort = keep_final  # sent once its GENERATE is
                if not keep_final:
                    del self._resubmitting[rid]  # ... or, not to be kept, never sent at all
            else:
                by_replica.setdefault(index, []).append(rid)
            if not keep_final:
                self._forget(rid)
        if not keep_final:
            self._drop_queued(set(ids))
        for index, rids in by_replica.items():
            replica = self.replicas[index]
            if not replica.is_dead:
                await replica.abort_request(rids, keep_final=keep_final)

    def end_request(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        self._forget(request_id)
        if index is not None:
            self.replicas[index].end_request(request_id)

    def _forget(self, request_id: str) -> None:
        self._owner.pop(request_id, None)
        self._retryable.pop(request_id, None)
        self._manual_end.discard(request_id)
        self._finished.discard(request_id)
        group = self._group_of.pop(request_id, None)
        if group is not None:
            bound = self._group_replica[group]
            bound[1] -= 1
            if bound[1] == 0:
                del self._group_replica[group]

    # -------------------------------------------------------------- outputs
    def _on_items(self, index: int, items: list[StageItem]) -> None:
        """A replica's batch (its client already dropped what is not in flight there)."""
        for item in items:
            rid = item.request_id
            if isinstance(item, OmniRequestOutput):
                self._retryable.pop(rid, None)
                if item.finished:
                    if rid in self._manual_end:
                        self._finished.add(rid)
                    else:
                        self._forget(rid)
            else:
                self._forget(rid)
        self._put_batch(items)

    def _put_batch(self, items: list[StageItem]) -> None:
        self._outputs.put(items)

    async def get_outputs_async(self) -> list[StageItem]:
        """The next batch of any replica; raises ``StageDeadError`` once no replica lives."""
        return await self._outputs.get_batch(lambda: self.dead_error)

    async def get_output_async(self) -> OmniRequestOutput:
        return await self._outputs.get_one(lambda: self.dead_error)

    def _drop_queued(self, request_ids: set[str]) -> None:
        self._outputs.drop(request_ids)

    # ---------------------------------------------------------------- death
    def _on_replica_dead(self, index: int, error: StageDeadError) -> None:
        """Replica ``index`` died (not at shutdown): evict it; move or fail what it ran."""
        if self._stopped:
            return
        lost = [rid for rid, i in self._owner.items() if i == index]
        if not self.live:
            # Nowhere to move anything: the stage is dead, and the orchestrator
            # fails every request that needs it.
            self._set_dead(error if len(self.replicas) == 1 else StageDeadError(
                self.stage_id, f"stage {self.stage_id}: every replica is dead (the last, replica {index}: "
                               f"{error})", error.exit_code, replica=index))
        else:
            reason = str(error).splitlines()[0]
            logger.warning("stage %d: replica %d died (%s); %d request(s) to move or fail",
                           self.stage_id, index, reason, len(lost))
            for rid in lost:
                self._move_or_fail(rid, index, reason)
        self._evictions.add(self._spawn(self.replicas[index].shutdown(), f"stage{self.stage_id}-evict{index}"))
        if self.on_replica_dead is not None:
            self.on_replica_dead(index, error)

    def _move_or_fail(self, rid: str, index: int, reason: str) -> None:
        if rid in self._finished:  # done there; what it held went with the replica
            self._forget(rid)
            return
        submission = self._retryable.get(rid)
        if submission is None:
            why = ("it had produced output already" if self.retry is RetryPolicy.BEFORE_FIRST_OUTPUT
                   else "runtime.retry is never")
            self._forget(rid)
            self._put_batch([StageDeadError(
                self.stage_id, f"stage {self.stage_id} replica {index} died while running request {rid!r} "
                               f"({reason}); not retried: {why}", replica=index, request_id=rid)])
            return
        target = self._pick(self._group_of.get(rid))
        self._bind(rid, target)
        self.resubmitted += 1
        resubmission = self._resubmitting[rid] = _Resubmission(target)
        self._spawn(self._resubmit(rid, resubmission, submission), f"stage{self.stage_id}-retry")

    async def _resubmit(self, rid: str, resubmission: _Resubmission, submission: _Submission) -> None:
        if self._resubmitting.get(rid) is not resubmission:
            return  # aborted meanwhile
        replica = self.replicas[resubmission.replica]
        try:
            await replica.submit_request(rid, submission.prompt, submission.sampling_params,
                                         end_on_finish=submission.end_on_finish, trace=submission.trace,
                                         deadline=submission.deadline, stream_states=submission.stream_states,
                                         lora_request=submission.lora_request)
            if resubmission.abort is not None:
                await replica.abort_request([rid], keep_final=resubmission.abort)
        except Exception as exc:  # noqa: BLE001 - the request fails, naming why
            if self._owner.get(rid) == resubmission.replica and not self._stopped:
                self._forget(rid)
                self._put_batch([StageDeadError(
                    self.stage_id, f"stage {self.stage_id}: request {rid!r} could not be moved to replica "
                                   f"{resubmission.replica}: {exc}", replica=resubmission.replica, request_id=rid)])
        finally:
            if self._resubmitting.get(rid) is resubmission:
                del self._resubmitting[rid]

    def _set_dead(self, error: StageDeadError) -> None:
        if self.dead_error is None:
            self.dead_error = error
        for rid in list(self._owner):
            self._forget(rid)
        self._resubmitting.clear()
        self._outputs.wake()  # readers see dead_error once the queue is drained

    def _spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._evictions.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("stage %d: %s failed", self.stage_id, task.get_name(), exc_info=task.exception())

    # -------------------------------------------------------- health, utility
    async def check_health(self, timeout: float = 10.0) -> None:
        """Healthy while one replica answers healthy; else the stage's (or a replica's) error."""
        self._check_alive()
        live = [self.replicas[i] for i in self.live]
        results = await asyncio.gather(*(r.check_health(timeout) for r in live), return_exceptions=True)
        if any(result is None for result in results):
            return
        raise next(result for result in results if isinstance(result, BaseException))

    async def call_each_replica_async(self, utility: str, /, *args: Any, call_timeout: float | None = None,
                                      return_exceptions: bool = False, **kwargs: Any) -> dict[int, Any]:
        """Call an engine method on every live replica: replica index -> result (or, with
        ``return_exceptions``, the error of a replica that failed)."""
        self._check_alive()
        live = self.live
        results = await asyncio.gather(*(
            self.replicas[i].call_utility_async(utility, *args, call_timeout=call_timeout, **kwargs) for i in live),
            return_exceptions=return_exceptions)
        return dict(zip(live, results))

    async def call_utility_async(self, utility: str, /, *args: Any, call_timeout: float | None = None,
                                 **kwargs: Any) -> Any:
        """Call an engine method on every live replica (pause, sleep ... apply to all); the first
        live replica's result stands for the stage."""
        results = await self.call_each_replica_async(utility, *args, call_timeout=call_timeout, **kwargs)
        return results[min(results)]
