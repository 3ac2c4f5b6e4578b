"""``Pipeline``: the seed's rounds, verification, early stop and shards, over any sampler.

Each item runs its own rounds: ``step_size`` answers per round (fewer in the
last, never past ``max_rollouts``), truncated answers (finish reason
``length``) dropped, the rest scored by the verifier; the item stops when every
formatter ``is_satisfied`` (with ``early_stop``), at ``max_rollouts`` kept
answers, or after ``max_steps`` rounds. An item's next round is queued as soon
as its previous one is back, so no item waits for the slowest of a round.
Seeds are per item and round: the lines do not depend on scheduling, on the
sampler's worker count, or on a crash and resume in between.

Shards overlap: the next shard's items are queued once fewer tasks are pending
than the sampler has lanes, so the tail of one shard does not leave lanes
idle; a shard is written as soon as its last item finishes. With a transfer
queue configured, an item's rollouts are written there when it finishes, before
its shard can be written, so a finished shard is in the queue too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from omni_engine.sampling.base import BaseSampler, WorkQueue
from omni_engine.sampling.config import SampleConfig
from omni_engine.sampling.items import ItemResult, SampleTask, check_metadata, item_seed, read_items
from omni_engine.sampling.publish import RolloutPublisher
from omni_engine.sampling.shards import OutputDir, ShardJournal
from omni_engine.sampling.verifiers import Formatter, Verifier, load_formatter, load_verifier

TRUNCATED = "length"


@dataclass
class ShardRun:
    """One shard in progress: its items' states, its journal, how many items are not finished."""

    index: int
    journal: ShardJournal
    states: dict[str, ItemState]
    unfinished: int = 0


@dataclass
class ItemState:
    """One item's progress through its rounds."""

    item: dict[str, Any]
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    rounds: int = 0
    truncated: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)


class RunSummary(msgspec.Struct, kw_only=True):
    items: int = 0
    shards: int = 0
    shards_skipped: int = 0
    requests: int = 0
    requests_replayed: int = 0
    responses: int = 0
    rollouts: int = 0
    correct: int = 0
    truncated: int = 0
    failed_requests: int = 0
    completion_tokens: int = 0
    published: int = 0  # trajectories new to the transfer queue (transfer_queue set)
    already_published: int = 0  # ... written again after a resume: the queue had them
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


class ProgressSink(Protocol):
    """What the Pipeline reports as it goes (the CLI's progress bar)."""

    def start(self, total_items: int, done_items: int) -> None: ...
    def update(self, summary: RunSummary, items_done: int, accepted: int) -> None: ...
    def close(self) -> None: ...


def load_items(config: SampleConfig, verifier: Verifier | None = None) -> list[dict[str, Any]]:
    """The input's items, checked: ids, messages, and what the verifier needs in their metadata."""
    verifier = verifier or load_verifier(config.verifier.name, config.verifier.args)
    path = config.resolve(config.input.path)
    items = read_items(path)
    check_metadata(items, getattr(verifier, "required_metadata", ()), str(path))
    return items


class Pipeline:
    """Multi-round sampling of an input file into crash-safe shards (the seed's ``Pipeline``)."""

    def __init__(self, config: SampleConfig, sampler: BaseSampler, *, verifier: Verifier | None = None,
                 formatters: list[Formatter] | None = None, progress: ProgressSink | None = None,
                 manage_sampler: bool = True) -> None:
        """``manage_sampler``: ``run`` initializes the sampler and shuts it down (as the seed's
        does); False for a sampler the caller keeps across runs. With ``transfer_queue`` in the
        config, every finished item's rollouts are also written there (``publish.py``)."""
        self.cfg = config
        self.sampler = sampler
        self.verifier = verifier or load_verifier(config.verifier.name, config.verifier.args)
        self.formatters = formatters if formatters is not None else [
            load_formatter(f.name, f.args) for f in config.formatters]
        self.progress = progress
        self.manage_sampler = manage_sampler
        self.summary = RunSummary()
        self._items_done = 0
        self.accepted = 0  # rollouts scoring > 0 so far (the progress bar's)
        self._sampling_meta: dict[str, Any] = {}
        self.publisher = RolloutPublisher(config.transfer_queue) if config.transfer_queue is not None else None

    # ----------------------------------------------------------------- run
    async def run(self, items: list[dict[str, Any]] | None = None) -> RunSummary:
        """Sample every item of the input (``items``: already read by ``load_items``, else read here)."""
        items = self.load_data() if items is None else items
        out = OutputDir(self.cfg.resolve(self.cfg.output.dir), self.cfg.run_settings(),
                        self.cfg.resolve(self.cfg.input.path), len(items))
        out.open()
        self.summary = RunSummary(items=len(items))
        started = time.monotonic()
        try:
            if self.publisher is not None:  # first: a wrong address fails in seconds, before any model loads
                await self.publisher.start(out.run_id)
            if self.manage_sampler:
                await self.sampler.initialize()
            started = time.monotonic()  # sampling time, not the sampler's start-up
            self._sampling_meta = self.sampler.describe()  # the same on every line of the run
            shards = list(self.shard_items(items))
            todo = [i for i in range(len(shards)) if not out.shard_done(i)]
            self.summary.shards_skipped = len(shards) - len(todo)
            self._items_done = len(items) - sum(len(shards[i]) for i in todo)
            if self.progress is not None:
                self.progress.start(len(items), self._items_done)
            await self._run_shards([(i, shards[i]) for i in todo], out)
            self.summary.seconds = time.monotonic() - started
            out.finish(msgspec.to_builtins(self.summary))
            return self.summary
        finally:
            self.summary.seconds = time.monotonic() - started
            if self.progress is not None:
                self.progress.close()
            if self.publisher is not None:
                await self.publisher.close()
            if self.manage_sampler:
                await self.sampler.shutdown()

    def load_data(self) -> list[dict[str, Any]]:
        return load_items(self.cfg, self.verifier)

    def shard_items(self, items: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        size = self.cfg.shard.size
        for i in range(0, len(items), size):
            yield items[i:i + size]

    # ------------------------------------------------------------- rounds
    async def _run_shards(self, shards: list[tuple[int, list[dict[str, Any]]]], out: OutputDir) -> None:
        """Every round of every item of ``shards`` through one WorkQueue (see the module docstring)."""
        work = WorkQueue()
        capacity = len(self.sampler.lanes())
        waiting = iter(shards)
        runs: dict[str, ShardRun] = {}  # item id -> its shard's run (ids are unique in the input)
        pending = 0  # tasks queued or in flight

        async def open_shards() -> None:
            nonlocal pending
            while pending < capacity and (nxt := next(waiting, None)) is not None:
                run = self._open_shard(*nxt, out)
                runs.update(dict.fromkeys(run.states, run))
                for state in run.states.values():
                    if self._finished(state):
                        await self._publish(state)  # finished before a crash: maybe not in the queue yet
                    else:
                        work.put(self._task(state))
                        pending += 1
                if run.unfinished == 0:
                    close(run)

        def close(run: ShardRun) -> None:
            self._close_shard(run, out)
            for item_id in run.states:  # a finished shard's lines are on disk; let them go
                del runs[item_id]

        try:
            await open_shards()
            if pending == 0:
                work.close()
            self._report()
            async for result in self.sampler.stream(work):
                run = runs[result.item_id]
                run.journal.append(result)
                state = run.states[result.item_id]
                self._apply(state, result)
                self._count(result)
                pending -= 1
                if self._finished(state):
                    await self._publish(state)  # before its shard can close: a done shard is in the queue
                    self._items_done += 1
                    run.unfinished -= 1
                    if run.unfinished == 0:
                        close(run)
                else:
                    work.put(self._task(state))
                    pending += 1
                await open_shards()
                if pending == 0:
                    work.close()
                self._report()
        finally:
            for run in set(runs.values()):
                run.journal.close()

    def _open_shard(self, index: int, items: list[dict[str, Any]], out: OutputDir) -> ShardRun:
        """A shard's run, with what its journal recorded before a crash folded in."""
        run = ShardRun(index, out.journal(index), {item["id"]: ItemState(item) for item in items})
        for result in run.journal.replay():
            state = run.states.get(result.item_id)
            if state is not None and result.round == state.rounds:
                self._apply(state, result)
                self.summary.requests_replayed += 1
        run.unfinished = sum(1 for state in run.states.values() if not self._finished(state))
        self._items_done += len(items) - run.unfinished
        return run

    def _close_shard(self, run: ShardRun, out: OutputDir) -> None:
        out.write_shard(run.index, [self._line(state) for state in run.states.values()], run.journal)
        self.summary.shards += 1

    async def _publish(self, state: ItemState) -> None:
        if self.publisher is not None and state.rollouts:
            new, known = await self.publisher.publish(state.item, state.rollouts)
            self.summary.published += new
            self.summary.already_published += known

    def _task(self, state: ItemState) -> SampleTask:
        rounds = self.cfg.sampling
        n = min(rounds.step_size, rounds.max_rollouts - len(state.rollouts))
        seed = item_seed(self.cfg.sampler.seed, state.item["id"], state.rounds)
        return SampleTask(state.item, n, state.rounds, seed)

    def _apply(self, state: ItemState, result: ItemResult) -> None:
        """Fold one round's result into the item (the same on first run and on replay)."""
        if result.error is not None:
            state.errors.append({"round": result.round, "error": result.error})
        for response in result.responses:
            if response.finish_reason == TRUNCATED:
                state.truncated += 1
                continue
            score = float(self.verifier.verify(response.text, state.item["metadata"]))
            state.rollouts.append({"response": response.text, "score": score,
                                   "finish_reason": response.finish_reason, "round": result.round,
                                   "prompt_tokens": response.prompt_tokens,
                                   "completion_tokens": response.completion_tokens})
            self.accepted += score > 0
        state.rounds += 1

    def _finished(self, state: ItemState) -> bool:
        rounds = self.cfg.sampling
        if state.rounds >= rounds.max_steps or len(state.rollouts) >= rounds.max_rollouts:
            return True
        return rounds.early_stop and all(f.is_satisfied(state.rollouts) for f in self.formatters)

    def _count(self, result: ItemResult) -> None:
        s = self.summary
        s.requests += 1
        s.failed_requests += result.error is not None
        s.responses += len(result.responses)
        for response in result.responses:
            s.completion_tokens += response.completion_tokens or 0
            s.truncated += response.finish_reason == TRUNCATED

    def _line(self, state: ItemState) -> dict[str, Any]:
        self.summary.rollouts += len(state.rollouts)
        self.summary.correct += sum(1 for r in state.rollouts if r["score"] > 0)
        line = {**state.item, "rollouts": state.rollouts, "rounds": state.rounds,
                "truncated": state.truncated, "sampling": self._sampling_meta}
        if state.errors:
            line["errors"] = state.errors
        return line

    def _report(self) -> None:
        if self.progress is not None:
            self.progress.update(self.summary, self._items_done, self.accepted)


def output_lines(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every line of a run's shards, in shard order (for tests and tools)."""
    lines = []
    for path in sorted(Path(output_dir).glob("shard_*.jsonl")):
        lines.extend(msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line.strip())
    return lines
