"""Timing a model's coroutine step by step (``omni_engine.engines.loop_holds``): only the steps
that hold the loop are reported, and the coroutine behaves exactly as it would unwrapped
(its result, its errors, its cancellation)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from omni_engine.engines.loop_holds import LoopHoldReport, timed_steps

ASYNC = pytest.mark.asyncio(loop_scope="session")

HOLD_S, LIMIT_S = 0.15, 0.1


@ASYNC
async def test_only_steps_that_hold_the_loop_are_reported_and_the_result_comes_through():
    async def model() -> int:
        time.sleep(HOLD_S)  # step 1 holds
        await asyncio.sleep(0.3)  # waiting is no hold
        time.sleep(HOLD_S)  # step 2 holds
        return 7

    reports: list[float] = []
    assert await timed_steps(model(), LIMIT_S, reports.append) == 7
    # (Another step could be reported only if this process was stalled 0.1 s outside the model.)
    assert sum(1 for held in reports if held >= HOLD_S) == 2 and all(held < 0.3 for held in reports), reports


@ASYNC
async def test_errors_and_cancellation_reach_the_model_as_unwrapped():
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        await timed_steps(fails(), LIMIT_S, lambda held: None)

    seen: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    task = asyncio.create_task(timed_steps(waits_forever(), LIMIT_S, lambda held: None))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "finally"]


@ASYNC
async def test_garbage_collection_during_a_step_is_not_the_models_hold():
    garbage = []
    for _ in range(1_000_000):  # enough reference cycles that a full collection takes a while
        a: list = []
        a.append(a)
        garbage.append(a)
    del garbage

    async def collects() -> None:
        t0 = time.perf_counter()
        gc.collect()
        collected_s.append(time.perf_counter() - t0)

    collected_s: list[float] = []
    reports: list[float] = []
    await timed_steps(collects(), 0.02, reports.append)
    assert collected_s[0] >= 0.05, f"the collection took {collected_s[0]:.4f} s: too quick to tell anything"
    # Counted, the step would be at least the collection's length.
    assert not any(held >= 0.9 * collected_s[0] for held in reports), (reports, collected_s)


def test_the_report_warns_once_a_period_counting_every_hold(caplog):
    report = LoopHoldReport(3, limit_s=0.1, warn_every_s=60.0)
    with caplog.at_level("WARNING", logger="omni_engine.engines.loop_holds"):
        for held in (0.2, 0.5, 0.3):
            report(held)
    assert report.holds == 3 and report.longest_s == 0.5
    (record,) = caplog.records
    assert "stage 3: its model held the client's event loop for 0.200 s" in record.getMessage()
