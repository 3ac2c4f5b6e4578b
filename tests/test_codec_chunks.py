"""Qwen3-Omni's codec chunking (``code2wav_chunks``): which frames go to code2wav when, as the talker
makes them one a step; and what a listener at 1x hears of a talker that runs at a given speed."""

from __future__ import annotations

import numpy as np
import pytest

from omni_engine.bench.playback import play
from omni_engine.models.qwen3_omni_moe.code2wav_chunks import CodecChunks, CodecStream

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
