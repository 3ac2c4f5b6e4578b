"""Unit tests of deadlines and the playback clock that need no speech stage (the mutation run's
selection for ``omni_engine/deadlines.py`` and ``omni_engine/pipeline/playback_clock.py``, with
tests/test_deadlines.py's unmarked tests; docs/mutation.md)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from omni_engine.deadlines import (
    CHARS_PER_SECOND,
    DEADLINE_LATE,
    DEADLINE_MAX_LATENESS,
    DEADLINE_SERVED,
    NO_DEADLINE_SLACK_S,
    DeadlineStats,
    EdfQueue,
    effective_deadline,
    estimate_speech_seconds,
)
from omni_engine.pipeline.playback_clock import PlaybackClock, speed_of
from omni_engine.stage_output import SPOKEN_SECONDS


# ------------------------------------------------------------------ deadlines
def test_a_request_without_deadline_or_arrival_is_due_the_slack_after_now():
    before = time.time()
    due = effective_deadline(None)
    assert before + NO_DEADLINE_SLACK_S <= due <= time.time() + NO_DEADLINE_SLACK_S


def test_speech_seconds_are_characters_over_the_speaking_rate():
    text = "x" * 198
    assert estimate_speech_seconds(text) == pytest.approx(198 / CHARS_PER_SECOND)
    assert estimate_speech_seconds(f"  {text}\n") == estimate_speech_seconds(text)  # surrounding blanks say nothing
    assert estimate_speech_seconds(text, speed=2.0) == pytest.approx(estimate_speech_seconds(text) / 2)
    assert estimate_speech_seconds(text, speed=0.5) == pytest.approx(estimate_speech_seconds(text) * 2)


@pytest.mark.parametrize("speed", [0.0, -1.0])
def test_a_speed_that_is_not_positive_counts_as_normal_speed(speed):
    assert estimate_speech_seconds("hello there", speed=speed) == estimate_speech_seconds("hello there")


def test_an_edf_queue_is_truthy_exactly_while_it_holds_items():
    queue: EdfQueue[str] = EdfQueue()
    assert not queue and len(queue) == 0
    queue.push("a", 1.0)
    assert queue and len(queue) == 1
    assert queue.pop() == ("a", 1.0)
    assert not queue


def test_deadline_stats_start_empty():
    assert DeadlineStats().snapshot() == {"served": 0, "late": 0, "max_lateness_s": 0.0, "recent": []}


def test_deadline_stats_count_late_pieces_and_keep_the_worst_lateness():
    stats = DeadlineStats()
    stats.finished(deadline=10.0, now=10.0)  # done exactly on time: not late
    stats.finished(deadline=10.0, now=9.0)
    assert stats.snapshot()["late"] == 0 and stats.snapshot()["max_lateness_s"] == 0.0
    stats.finished(deadline=10.0, now=10.5)
    stats.finished(deadline=10.0, now=12.0)
    stats.finished(deadline=10.0, now=11.0)
    snap = stats.snapshot()
    assert (snap["served"], snap["late"], snap["max_lateness_s"]) == (5, 3, 2.0)
    stats.finished(deadline=0.0, now=2.123456)
    assert stats.snapshot()["max_lateness_s"] == 2.1235  # rounded to 0.1 ms


def test_deadline_stats_keep_the_order_work_began_the_last_recent_of_it():
    stats = DeadlineStats()
    stats.started("a", 2.0)
    stats.started("b", 1.0)
    assert stats.snapshot()["recent"] == [["a", 2.0], ["b", 1.0]]
    for i in range(DeadlineStats.RECENT):
        stats.started(f"r{i}", float(i))
    recent = stats.snapshot()["recent"]
    assert len(recent) == DeadlineStats.RECENT and recent[0] == ["r0", 0.0] and recent[-1][0] == f"r{DeadlineStats.RECENT - 1}"


def test_deadline_stats_families_carry_the_same_figures():
    stats = DeadlineStats()
    stats.finished(deadline=1.0, now=1.5)
    stats.finished(deadline=1.0, now=0.5)
    families = {family[0]: family for family in stats.families()}
    assert {name: family[1] for name, family in families.items()} == {
        DEADLINE_SERVED: "counter", DEADLINE_LATE: "counter", DEADLINE_MAX_LATENESS: "gauge"}
    samples = {sample[0]: sample[2] for family in families.values() for sample in family[3]}
    assert samples == {DEADLINE_SERVED + "_total": 2.0, DEADLINE_LATE + "_total": 1.0, DEADLINE_MAX_LATENESS: 0.5}
    assert all(isinstance(family[2], str) and family[2] for family in families.values())  # a HELP line each


# ------------------------------------------------------------------ the playback clock
def test_a_prompt_without_text_gives_no_estimate():
    clock = PlaybackClock(100.0)
    clock.note_input(0, [101, 102, 103])  # token ids: nothing to estimate from
    clock.note_input(1, {"prompt_token_ids": [1, 2]})
    assert clock.deadline(2) == 100.0


def test_a_piece_with_no_estimate_counts_zero_seconds():
    clock = PlaybackClock(100.0)
    clock.note_input(1, "Piece one has words.")  # piece 0 never said how long it is
    assert clock.deadline(1) == 100.0
    assert clock.deadline(2) == pytest.approx(100.0 + estimate_speech_seconds("Piece one has words."))


@pytest.mark.parametrize("params, speed", [
    ({"speed": 1.5}, 1.5),
    ({"speed": "2"}, 2.0),
    (SimpleNamespace(speed=0.75), 0.75),
    ({}, 1.0),
    ({"speed": None}, 1.0),
    ({"speed": 0}, 1.0),
    ({"speed": "fast"}, 1.0),
    ({"speed": [2]}, 1.0),
    (SimpleNamespace(), 1.0),
    (None, 1.0),
])
def test_speed_of_reads_the_speed_and_falls_back_to_normal(params, speed):
    assert speed_of(params) == speed


def test_pop_batch_takes_the_earliest_and_then_only_its_key_the_others_keep_their_places():
    queue: EdfQueue[str] = EdfQueue()
    for item, deadline in [("a1", 1.0), ("b2", 2.0), ("b2'", 2.0), ("a3", 3.0), ("gone", 0.5), ("a4", 4.0)]:
        queue.push(item, deadline)
    batch = queue.pop_batch(2, key=lambda item: item[0], live=lambda item: item != "gone")
    assert batch == [("a1", 1.0), ("a3", 3.0)]  # "gone" dropped; a4 past the limit
    assert queue.pop_batch(8, key=lambda item: item[0]) == [("b2", 2.0), ("b2'", 2.0)]  # order kept
    assert queue.pop_batch(8) == [("a4", 4.0)] and not queue


def test_a_codec_piece_s_stated_length_sets_the_deadlines_after_it():
    """A piece that says how long it will be (``SPOKEN_SECONDS``, a codec piece's codes) moves the
    pieces after it back by that, before any audio exists; speech speed does not scale it."""
    clock = PlaybackClock(100.0, speed=2.0)
    clock.note_input(0, {"codes": [1, 2], SPOKEN_SECONDS: 0.24})
    clock.note_input(1, {"codes": [3], SPOKEN_SECONDS: True})  # not a length: no estimate
    clock.note_input(2, {"codes": [4], SPOKEN_SECONDS: -1.0})
    assert clock.deadline(1) == pytest.approx(100.24)
    assert clock.deadline(3) == pytest.approx(100.24)
    clock.heard(0, 0.3, now=101.0)  # the real audio replaces the stated length
    assert clock.deadline(1) == pytest.approx(101.3)
