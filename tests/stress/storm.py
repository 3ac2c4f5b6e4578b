"""The abort storm: requests through the speech pipeline, a random subset aborted at a random point.

Each aborted request is planned with a *kind* (where to abort) and a *method*
(how the abort reaches the pipeline): ``abort`` is ``await client.abort(id)``;
``close`` is the caller closing the stream (``aclose``) or, from outside,
cancelling the task that reads it (a disconnecting HTTP client); ``drop`` is
the caller walking away from the stream, which the event loop's async
generator finalizer then closes. Where the request really was when the abort
hit (its *phase*) is recorded, since a planned point may be overtaken by the
request itself (an abort after the stream's END is a no-op, and that is
checked too). Requests that end without an abort must be complete: text and
audio, each final stage finished exactly once.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.pipeline.orchestrator import RequestAbortedError
from tests.stress.pipeline import text_params

KINDS = ("before_first", "mid_text", "mid_audio", "after_finish")
# Methods that make sense at each kind: before the first output the stream
# is being read by another task, which can be cancelled but not aclosed.
METHODS = {
    "before_first": ("abort", "close"),
    "mid_text": ("abort", "close", "drop"),
    "mid_audio": ("abort", "close", "drop"),
    "after_finish": ("abort", "close"),
}
FINAL_STAGES = (0, 1)  # text, audio


@dataclass(frozen=True)
class Plan:
    request_id: str
    prompt: str
    max_tokens: int
    kind: str | None = None  # None: read to the end
    method: str = "abort"
    # before_first: seconds after the start; mid_*: the output count that triggers it.
    at: float = 0.0


@dataclass
class Outcome:
    """What one request did, as seen by its caller."""

    plan: Plan
    phase: str | None = None  # where the request was when the abort hit
    result: str = "pending"  # finished | aborted | failed
    error: str | None = None
    text: str = ""
    text_outputs: int = 0
    audio_outputs: int = 0
    audio_samples: int = 0
    finished: list[int] = field(default_factory=list)  # final stages that reported finished, in order
    # Outputs whose completion says "abort": the stream of an aborted request ends with one.
    abort_outputs: int = 0
    seconds: float = 0.0

    def record(self, output: Any) -> None:
        if output.final_output_type == "text":
            self.text_outputs += 1
            if output.outputs:
                self.text += output.outputs[0].text
        else:
            audio = output.multimodal_output.get("audio") if output.multimodal_output else None
            self.audio_outputs += 1
            self.audio_samples += 0 if audio is None else len(audio)
        if output.finished:
            self.finished.append(output.stage_id)
        if any(c.finish_reason == "abort" for c in output.outputs):
            self.abort_outputs += 1

    def current_phase(self) -> str:
        if len(self.finished) == len(FINAL_STAGES):
            return "after_finish"
        if not self.text_outputs:
            return "before_first"
        if not self.audio_outputs and 0 not in self.finished:
            return "mid_text"
        return "mid_audio"  # the speech stage is at work (the text may be done)

    def triggered(self) -> bool:
        """Whether the abort planned for mid-stream is due now (never later than the end)."""
        kind, at = self.plan.kind, self.plan.at
        if kind == "mid_text":
            return self.text_outputs >= at or self.audio_outputs > 0 or 0 in self.finished
        if kind == "mid_audio":
            # at 1: as soon as the speech stage is at work; 2, 3: after that many
            # audio outputs; at the latest on the audio's last output.
            speaking = self.audio_outputs > 0 or 0 in self.finished
            return (speaking and self.audio_outputs >= at - 1) or 1 in self.finished
        return False

    def problems(self) -> list[str]:
        """Why this outcome is wrong (empty: it is right)."""
        rid = self.plan.request_id
        if self.result == "failed":
            return [f"request {rid}: failed: {self.error}"]
        if self.result == "aborted":
            if self.plan.kind is None:
                return [f"request {rid}: aborted but nobody aborted it"]
            if self.plan.method == "abort" and 0 not in self.finished:
                return [f"request {rid}: aborted by abort() but its stream has no final text output"]
            return []
        found = []
        if sorted(self.finished) != list(FINAL_STAGES):
            found.append(f"request {rid}: finished outputs of stages {self.finished}, expected one each of "
                         f"{list(FINAL_STAGES)}")
        if not self.text.strip():
            found.append(f"request {rid}: finished with no text")
        if not self.audio_samples:
            found.append(f"request {rid}: finished with no audio")
        return found


def make_plans(n: int, prompts: Sequence[str], seed: int, abort_fraction: float,
               max_tokens: tuple[int, int] = (16, 48), prefix: str = "storm") -> list[Plan]:
    """``n`` requests; about ``abort_fraction`` of them aborted, kinds and methods uniformly at random."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        prompt, tokens = rng.choice(prompts), rng.randint(*max_tokens)
        if rng.random() >= abort_fraction:
            plans.append(Plan(f"{prefix}-{i}", prompt, tokens))
            continue
        kind = rng.choice(KINDS)
        at = rng.uniform(0.001, 0.03) if kind == "before_first" else float(rng.randint(1, 2))
        plans.append(Plan(f"{prefix}-{i}", prompt, tokens, kind, rng.choice(METHODS[kind]), at))
    return plans


async def run_request(client: MultiStageEngineClient, plan: Plan, timeout: float) -> Outcome:
    """Run one planned request; a request with no end within ``timeout`` is a failure (a hang)."""
    outcome = Outcome(plan)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with asyncio.timeout(timeout):
            if plan.kind == "before_first":
                await _abort_from_outside(client, plan, outcome)
            else:
                await _read_stream(client, plan, outcome)
    except TimeoutError:
        outcome.result, outcome.error = "failed", f"no end within {timeout:.0f} s (phase {outcome.current_phase()})"
    except RequestAbortedError:
        outcome.result = "aborted"
    except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
        outcome.result, outcome.error = "failed", f"{type(exc).__name__}: {exc}"
    outcome.seconds = loop.time() - t0
    return outcome


async def _read_stream(client: MultiStageEngineClient, plan: Plan, outcome: Outcome) -> None:
    gen = client.generate(plan.prompt, text_params(plan.max_tokens), plan.request_id)
    async for output in gen:
        outcome.record(output)
        if outcome.phase is None and outcome.triggered():
            outcome.phase = outcome.current_phase()
            if plan.method == "abort":
                # The stream goes on: its final outputs (marked "abort"), or the
                # rest of a request that had ended before the abort.
                await client.abort(plan.request_id)
                continue
            if plan.method == "close":
                await gen.aclose()
            # "drop": leave without closing; the loop's async-generator
            # finalizer closes the stream once nothing references it.
            outcome.result = "aborted"
            return
    outcome.result = "aborted" if outcome.abort_outputs else "finished"
    if plan.kind == "after_finish":
        outcome.phase = outcome.current_phase()
        if plan.method == "abort":
            await client.abort(plan.request_id)  # must be a no-op
        else:
            await gen.aclose()


async def _abort_from_outside(client: MultiStageEngineClient, plan: Plan, outcome: Outcome) -> None:
    """Abort a request that another task reads, ``plan.at`` seconds after it started."""

    async def read() -> None:
        async for output in client.generate(plan.prompt, text_params(plan.max_tokens), plan.request_id):
            outcome.record(output)

    reader = asyncio.create_task(read(), name=f"storm-reader-{plan.request_id}")
    try:
        await asyncio.sleep(plan.at)  # the random point of the abort, not a synchronization
        outcome.phase = outcome.current_phase()
        if plan.method == "abort":
            await client.abort(plan.request_id)
        else:
            reader.cancel()  # the caller goes away, as a disconnecting HTTP client does
        await asyncio.wait({reader})
    finally:
        reader.cancel()  # only if we were cancelled meanwhile (timeout)
    if reader.cancelled():
        outcome.result = "aborted"
    elif reader.exception() is not None:
        raise reader.exception()
    else:
        # "finished": the abort came before the request reached the pipeline or after its end.
        outcome.result = "aborted" if outcome.abort_outputs else "finished"


async def run_storm(client: MultiStageEngineClient, plans: Sequence[Plan], concurrency: int,
                    timeout: float = 120.0) -> list[Outcome]:
    """Run ``plans`` with at most ``concurrency`` requests in flight; outcomes in plan order."""
    outcomes: list[Outcome | None] = [None] * len(plans)
    todo = iter(range(len(plans)))

    async def worker() -> None:
        for i in todo:
            outcomes[i] = await run_request(client, plans[i], timeout)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes  # type: ignore[return-value]


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts per planned kind and method, per real phase, per result; every problem found."""
    aborted = [o for o in outcomes if o.plan.kind is not None]
    return {
        "requests": len(outcomes),
        "planned_aborts": len(aborted),
        "by_kind": {k: dict(Counter(f"{o.plan.method}:{o.result}" for o in aborted if o.plan.kind == k))
                    for k in KINDS},
        "by_phase": dict(Counter(o.phase for o in aborted)),
        "results": dict(Counter(o.result for o in outcomes)),
        "not_aborted_finished": sum(1 for o in outcomes if o.plan.kind is None and o.result == "finished"),
        "seconds": {result: _quantiles([o.seconds for o in outcomes if o.result == result])
                    for result in ("finished", "aborted")},
        "slowest": [f"{o.plan.request_id} {o.result} {o.seconds:.1f}s kind={o.plan.kind} phase={o.phase} "
                    f"text_outputs={o.text_outputs} audio_outputs={o.audio_outputs}"
                    for o in sorted(outcomes, key=lambda o: -o.seconds)[:3]],
        "failures": [p for o in outcomes for p in o.problems()],
    }


def _quantiles(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``values`` (seconds), rounded for a summary."""
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5), 3), "p99": round(pick(0.99), 3), "max": round(ordered[-1], 3)}
