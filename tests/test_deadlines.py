"""Playback deadlines: a real eSpeak stage process serves earliest deadline first; the orchestrator's
clock gives each piece of a request's speech the moment its listener needs it."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_engine.deadlines import NO_DEADLINE_SLACK_S, EdfQueue, effective_deadline, estimate_speech_seconds
from omni_engine.pipeline.playback_clock import PlaybackClock
from omni_engine.stage_output import SPOKEN_TEXT

LONG_TEXT = " ".join(["The keeper climbed the narrow stairs to light the great lamp above the sea."] * 12)


async def stage_order(stage, prefix: str) -> list[tuple[str, float]]:
    stats = await stage.call_utility_async("deadline_stats")
    return [(rid, deadline) for rid, deadline in stats["recent"] if rid.startswith(prefix)]


@pytest.mark.tts
async def test_a_generation_stage_serves_queued_pieces_earliest_deadline_first(tts_stage):
    """Pieces queued behind a long one with deadlines out of order are spoken in deadline order;
    equal deadlines keep their arrival order; one already late is spoken first, and counted."""
    late_before = (await tts_stage.call_utility_async("deadline_stats"))["late"]
    await tts_stage.submit_request("edf-blocker", LONG_TEXT, None)
    async with asyncio.timeout(30):  # the blocker holds the stage while the others queue
        while not await stage_order(tts_stage, "edf-blocker"):
            await asyncio.sleep(0.01)
    now = time.time()
    due = {"edf-a": now + 30, "edf-b": now + 10, "edf-c": now + 20, "edf-late": now - 5,
           "edf-e1": now + 15, "edf-e2": now + 15}
    for rid, deadline in due.items():
        await tts_stage.submit_request(rid, f"Piece {rid[4:]}.", None, deadline=deadline)
    done: dict[str, int] = {}
    async with asyncio.timeout(60):
        while len(done) < len(due) + 1:
            for output in await tts_stage.get_outputs_async():
                done[output.request_id] = len(output.multimodal_output["audio"])
    order = await stage_order(tts_stage, "edf-")
    assert [rid for rid, _ in order] == ["edf-blocker", "edf-late", "edf-b", "edf-e1", "edf-e2", "edf-c", "edf-a"]
    assert [deadline for _, deadline in order[1:]] == pytest.approx(sorted(due.values()))
    # The blocker had none: it was due NO_DEADLINE_SLACK_S after it arrived.
    assert order[0][1] == pytest.approx(now + NO_DEADLINE_SLACK_S, abs=5.0)
    assert done["edf-late"] > 1000, "the late piece was not spoken"
    assert (await tts_stage.call_utility_async("deadline_stats"))["late"] >= late_before + 1


async def _spoken(stage, request_id: str, deadline: float) -> float:
    """Submit ``LONG_TEXT`` due at ``deadline``; the seconds until its audio came back."""
    started = time.monotonic()
    await stage.submit_request(request_id, LONG_TEXT, None, deadline=deadline)
    async with asyncio.timeout(60):
        while True:
            for output in await stage.get_outputs_async():
                if output.request_id == request_id and output.finished:
                    return time.monotonic() - started


@pytest.mark.tts
async def test_a_piece_is_late_exactly_when_it_is_done_after_its_deadline(tts_stage):
    """The late count moves by exactly the pieces done after their deadline: not one done in time, and
    one that was on time when it started but not when it was done (lateness is when the audio exists)."""
    async def late() -> int:
        return (await tts_stage.call_utility_async("deadline_stats"))["late"]

    before = await late()
    took = await _spoken(tts_stage, "late-in-time", time.time() + 60)
    assert await late() == before, "a piece done 60 s before its deadline was counted late"
    # Due a quarter of the way through its own rendering: in time at the start, late when done.
    await _spoken(tts_stage, "late-while-made", time.time() + took / 4)
    assert await late() == before + 1, "a piece done after its deadline was not counted (stamped at its start?)"


def test_the_playback_clock_estimates_then_follows_the_audio_heard():
    start = 1000.0
    clock = PlaybackClock(start)
    first, second = "Once upon a time,", "there lived a cat named Tom by the sea."
    clock.note_input(0, first)  # the phonemizer's piece 0 (text) ...
    clock.note_input(0, {SPOKEN_TEXT: "ignored: piece 0 has its estimate already"})
    clock.note_input(1, {SPOKEN_TEXT: second})  # ... and the voice's piece 1 (ids + its text)
    assert clock.deadline(0) == start
    assert clock.deadline(1) == pytest.approx(start + estimate_speech_seconds(first))
    assert clock.deadline(2) == pytest.approx(start + estimate_speech_seconds(first) + estimate_speech_seconds(second))
    # Piece 0's audio arrives late: the listener starts then, and its real length replaces the estimate.
    clock.heard(0, 0.75, now=start + 0.4)
    clock.heard(0, 0.5, now=start + 0.5)
    assert clock.deadline(0) == start + 0.4
    assert clock.deadline(1) == pytest.approx(start + 0.4 + 1.25)
    assert clock.deadline(2) == pytest.approx(start + 0.4 + 1.25 + estimate_speech_seconds(second))
    fast = PlaybackClock(start, speed=2.0)
    fast.note_input(0, first)
    assert fast.deadline(1) == pytest.approx(start + estimate_speech_seconds(first) / 2)


def test_edf_queue_orders_by_deadline_then_arrival():
    queue: EdfQueue[str] = EdfQueue()
    for item, deadline in (("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 1.0)):
        queue.push(item, deadline)
    assert [queue.pop()[0] for _ in range(4)] == ["b", "d", "c", "a"]
    assert effective_deadline(None, arrival=10.0) == 10.0 + NO_DEADLINE_SLACK_S
    assert effective_deadline(4.0, arrival=10.0) == 4.0
