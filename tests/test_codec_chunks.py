"""Qwen3-Omni's codec chunking (``code2wav_chunks``): which frames go to code2wav when, as the talker
makes them one a step; and what a listener at 1x hears of a talker that runs at a given speed, with
and without the ``ListenerPacer`` watching its clock."""

from __future__ import annotations

import numpy as np
import pytest

from omni_engine.bench.playback import play
from omni_engine.models.qwen3_omni_moe.code2wav_chunks import CodecChunks, CodecStream
from omni_engine.pipeline.listener_pacing import ListenerPacer
from omni_engine.pipeline.playback_clock import PlaybackClock

GROUPS = 4
FRAME_S = 0.08  # 12.5 Hz


def _pieces(chunks: CodecChunks, frames: int) -> list[tuple[int, dict]]:
    """(frames made when it left, piece) for a talker that makes one frame a step and then ends."""
    codes = np.arange(GROUPS * frames, dtype=np.int64).reshape(GROUPS, frames)
    stream, out = CodecStream(chunks), []
    for n in range(frames):
        out += [(n + 1, piece) for piece in stream.add(codes[:, n:n + 1], n)]
    out += [(frames, piece) for piece in stream.finish(codes)]
    return out


@pytest.mark.parametrize(("ramp", "sizes"), [(True, [4, 4, 8, 16, 25, 25, 18]), (False, [4, 25, 25, 25, 21])])
def test_pieces_leave_when_whole_join_to_every_frame_once_and_see_their_left_context(ramp, sizes):
    frames = sum(sizes)
    pieces = _pieces(CodecChunks(4, 25, 25, ramp), frames)
    new = [piece["codes"].shape[1] - piece["left_context"] for _, piece in pieces]
    assert new == sizes
    assert [made for made, _ in pieces] == list(np.cumsum(sizes)), "a piece waited for more frames than its own"
    joined = np.concatenate([piece["codes"][:, piece["left_context"]:] for _, piece in pieces], axis=1)
    np.testing.assert_array_equal(joined, np.arange(GROUPS * frames).reshape(GROUPS, frames))
    sent = np.cumsum([0, *sizes[:-1]])
    assert [piece["left_context"] for _, piece in pieces] == [min(25, int(s)) for s in sent]


@pytest.mark.parametrize("speed", [2.0, 2.5, 5.0])
def test_a_listener_never_waits_on_a_ramped_stream_from_a_talker_at_twice_real_time(speed):
    """A talker ``speed`` (>= 2) times faster than real time, decoding free: with the ramp, each piece
    is made while the audio before it plays; vLLM-Omni's plan (4, then 25) leaves a gap below 6x."""
    step_s = FRAME_S / speed

    def heard(ramp: bool):
        return play((made * step_s, (piece["codes"].shape[1] - piece["left_context"]) * FRAME_S)
                    for made, piece in _pieces(CodecChunks(4, 25, 25, ramp), 150))

    ramped, plain = heard(True), heard(False)
    assert ramped.underruns == 0, ramped
    assert plain.underruns >= 1, plain
    assert ramped.first_audio_s == plain.first_audio_s == pytest.approx(4 * step_s)


def _paced_stream(speed: float, latency_s: float, pacing: bool, frames: int = 150):
    """A talker at ``speed`` x real time feeding the edge one frame a step; each piece reaches the
    caller ``latency_s`` after it leaves (code2wav and the way back), which the request's
    ``PlaybackClock`` records as the orchestrator does. The pieces' new frames, and what a 1x
    listener heard."""
    clock = PlaybackClock(0.0)
    stream = CodecStream(CodecChunks(4, 25, 25, True), ListenerPacer(clock) if pacing else None)
    codes = np.arange(GROUPS * frames, dtype=np.int64).reshape(GROUPS, frames)
    on_the_way: list[tuple[float, int, float]] = []  # (arrival, piece, seconds)
    arrivals, sizes = [], []

    def arrive(until: float) -> None:
        while on_the_way and on_the_way[0][0] <= until:
            at, k, seconds = on_the_way.pop(0)
            clock.heard(k, seconds, at)
            arrivals.append((at, seconds))

    def send(pieces: list[dict], now: float) -> None:
        for piece in pieces:
            new = piece["codes"].shape[1] - piece["left_context"]
            sizes.append(new)
            on_the_way.append((now + latency_s, len(sizes) - 1, new * FRAME_S))

    now = 0.0
    for n in range(frames):
        now = (n + 1) * FRAME_S / speed
        arrive(now)
        send(stream.add(codes[:, n:n + 1], n, now), now)
    send(stream.finish(codes, now), now)
    arrive(float("inf"))
    return sizes, play(arrivals)


@pytest.mark.parametrize("speed", [1.1, 1.4, 1.7])
def test_a_paced_stream_never_leaves_its_listener_waiting_on_a_talker_below_twice_real_time(speed):
    """Below 2x the ramp alone leaves gaps; the pacer lets the frames made so far go early whenever
    waiting for the planned piece would land it after the listener runs dry."""
    sizes, paced = _paced_stream(speed, 0.06, pacing=True)
    _, planned = _paced_stream(speed, 0.06, pacing=False)
    assert planned.underruns >= 1, planned
    assert paced.underruns == 0, (paced, sizes)
    assert sum(sizes) == 150 and paced.first_audio_s == planned.first_audio_s
    assert min(sizes[:-1]) >= 4, sizes


def test_below_real_time_the_pacer_shortens_the_silence_without_pieces_below_the_first_s_size():
    """A talker at 0.9x: the listener waits whatever is sent; early pieces still keep to 4 frames
    (code2wav decodes each with its left context: single frames would multiply its work)."""
    sizes, paced = _paced_stream(0.9, 0.06, pacing=True)
    _, planned = _paced_stream(0.9, 0.06, pacing=False)
    assert min(sizes[:-1]) >= 4 and sum(sizes) == 150, sizes
    assert paced.underrun_s < 0.6 * planned.underrun_s, (paced, planned)


@pytest.mark.parametrize("speed", [2.5, 5.0])
def test_the_pacer_sends_nothing_early_when_the_plan_keeps_up(speed):
    sizes, paced = _paced_stream(speed, 0.06, pacing=True)
    plan, _ = _paced_stream(speed, 0.06, pacing=False)
    assert sizes == plan == [4, 4, 8, 16, 25, 25, 25, 25, 18]
    assert paced.underruns == 0


def test_the_pacer_waits_for_the_first_audio():
    """Nothing is heard yet: no piece goes early, however late the clock says it is."""
    clock = PlaybackClock(0.0)
    pacer = ListenerPacer(clock)
    pacer.sent(4, now=0.0)
    assert not pacer.due(now=100.0)
    clock.heard(0, 4 * FRAME_S, 0.05)
    assert pacer.due(now=100.0)  # the listener ran dry long ago
    assert not ListenerPacer(clock).due(now=100.0)  # nothing of its own sent: nothing to judge by
